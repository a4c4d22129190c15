"""What the engine needs from a model, whatever its origin (random tiny config, Wan2.1 from disk, the toy).

A registry entry turns a model name into a ``ModelBundle``; the engine only ever talks to this object, so the
benchmark, the demo and the workers run the same code path for every model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

# Imported from its module, not the package root: mypy resolves the root names to diffusers' dummy objects.
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from producer.catalog import ModelSpec


@dataclass
class TextEncoding:
    """A prompt as the transformer's cross-attention sees it.

    ``embeddings`` is ``(1, L, text_dim)`` exactly as passed to the transformer as ``encoder_hidden_states``;
    ``token_ids`` and ``tokens`` have one entry per position (padding included) so the engine can tell which
    prompt tokens differ between two requests; ``valid`` marks real (non-padding) positions. ``prompt_tokens`` is
    how many tokens the whole prompt has (None: not counted), more than ``used_tokens`` when the text encoder's
    budget cut it.
    """

    embeddings: torch.Tensor
    token_ids: list[int]
    tokens: list[str]
    valid: list[bool]
    prompt_tokens: int | None = None

    @property
    def used_tokens(self) -> int:
        return sum(self.valid)

    @property
    def truncated(self) -> bool:
        return self.prompt_tokens is not None and self.prompt_tokens > self.used_tokens


@dataclass
class ModelBundle:
    spec: ModelSpec
    transformer: WanTransformer3DModel
    # A fresh scheduler per request: diffusers schedulers keep per-run state (step index, multistep history).
    make_scheduler: Callable[[], SchedulerMixin]
    encode_prompt: Callable[[str], TextEncoding]
    # (num_frames, height, width) -> latent shape (C, F', H', W') without the batch dimension.
    latent_shape: Callable[[int, int, int], tuple[int, int, int, int]]
    # latent (1, C, F', H', W') -> uint8 frames (F, H, W, 3)
    decode: Callable[[torch.Tensor], np.ndarray]
    # Identifies the weights (e.g. sha256 of the safetensors file, or the random seed of a random model).
    weights_id: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    # Frames per second of the videos this model makes (for encoding only).
    fps: int = 8
