"""What each registered model can produce, as plain data.

The contract validates requests against this catalog without importing torch, so producers, the
scheduler and the workers agree on which models exist and which shapes they accept. The engine's model
registry (``workers.engine.registry``) must hold one loader for every name listed here.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class IntRule(BaseModel):
    """Allowed values of one integer request field: ``minimum <= v <= maximum`` and ``v % modulus == remainder``."""

    model_config = ConfigDict(frozen=True)

    minimum: int
    maximum: int
    modulus: int = 1
    remainder: int = 0

    def check(self, value: int) -> str | None:
        """Return why ``value`` is not allowed, or None when it is."""
        if self.minimum == self.maximum and value != self.minimum:
            return f"must be {self.minimum}"
        if not self.minimum <= value <= self.maximum:
            return f"must be between {self.minimum} and {self.maximum}"
        if value % self.modulus != self.remainder:
            if self.remainder == 0:
                return f"must be a multiple of {self.modulus}"
            return f"must be {self.modulus}·k+{self.remainder}"
        return None

    def describe(self) -> str:
        rule = f"{self.minimum}..{self.maximum}"
        if self.modulus != 1:
            rule += f", ≡{self.remainder} mod {self.modulus}"
        return rule


class ModelSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    num_frames: IntRule
    height: IntRule
    width: IntRule
    num_steps: IntRule = IntRule(minimum=1, maximum=200)
    default_num_frames: int
    default_height: int
    default_width: int
    default_num_steps: int
    default_guidance_scale: float = 1.0
    # Names the sampling scheduler and its configuration. Trajectories are only interchangeable between
    # requests that denoise with the same scheduler, so this is part of the compatibility key.
    scheduler: str = Field(min_length=1)


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="tiny-random-wan",
            description="A tiny Wan-architecture transformer with fixed random weights (tests, benchmarks).",
            num_frames=IntRule(minimum=1, maximum=33),
            height=IntRule(minimum=16, maximum=256, modulus=16),
            width=IntRule(minimum=16, maximum=256, modulus=16),
            default_num_frames=8,
            default_height=32,
            default_width=32,
            default_num_steps=4,
            scheduler="flow-euler-shift1",
        ),
        ModelSpec(
            name="toy",
            description="Chorus' own toy text-to-video model: one colored shape moving over a background.",
            num_frames=IntRule(minimum=8, maximum=8),
            height=IntRule(minimum=32, maximum=32),
            width=IntRule(minimum=32, maximum=32),
            default_num_frames=8,
            default_height=32,
            default_width=32,
            default_num_steps=4,
            # Trained with caption dropout for classifier-free guidance. All-attribute accuracy of the committed
            # weights on 256 held-out prompts at 4 steps: g=1.5 95%, 2 96%, 2.5 96%, 3 94%, 4 85%; at 50 steps
            # (128 prompts) g=2 100%, g=3 99%.
            default_guidance_scale=2.0,
            scheduler="flow-euler-shift1",
        ),
        ModelSpec(
            name="wan2.1-t2v-1.3b",
            description="Wan2.1 text-to-video 1.3B, loaded from a local diffusers directory.",
            # The Wan VAE compresses time 4× with the first frame kept: 4k+1 frames.
            num_frames=IntRule(minimum=1, maximum=121, modulus=4, remainder=1),
            # VAE 8× spatial compression times the transformer's 2×2 patches.
            height=IntRule(minimum=128, maximum=1280, modulus=16),
            width=IntRule(minimum=128, maximum=1280, modulus=16),
            default_num_frames=33,
            default_height=480,
            default_width=832,
            default_num_steps=50,
            default_guidance_scale=5.0,
            scheduler="unipc-flow-shift3",
        ),
    )
}


class ModelName(StrEnum):
    """The catalog's names, for command-line options that list them as choices (a unit test keeps the two equal)."""

    TOY = "toy"
    TINY_RANDOM_WAN = "tiny-random-wan"
    WAN21_T2V_1_3B = "wan2.1-t2v-1.3b"


def get_spec(name: str) -> ModelSpec | None:
    return CATALOG.get(name)


def compatibility_key(model: str, num_frames: int, height: int, width: int, num_steps: int) -> str:
    """Requests may exchange trajectories only when this key is equal (same model, shape, steps, scheduler)."""
    spec = CATALOG[model]
    return f"{model}|f{num_frames}|{height}x{width}|s{num_steps}|{spec.scheduler}"
