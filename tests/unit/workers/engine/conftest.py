from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from producer.contract import GenerationRequest, build_request
from workers.engine import Engine, ModelBundle, load_bundle

MODEL = "tiny-random-wan"


@pytest.fixture(scope="session")
def tiny_bundle() -> ModelBundle:
    return load_bundle(MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def engine(tiny_bundle: ModelBundle) -> Engine:
    return Engine(tiny_bundle)


@pytest.fixture
def plain_bundle() -> ModelBundle:
    """A second, never-instrumented copy of the tiny model (same seed → same weights)."""
    return load_bundle(MODEL, device="cpu", dtype="float32")


@pytest.fixture
def make_request() -> Callable[..., GenerationRequest]:
    def make(prompt: str = "a red circle moving left on a white background", **kw: Any) -> GenerationRequest:
        fields: dict[str, Any] = {
            "prompt": prompt,
            "model": MODEL,
            "num_frames": 4,
            "height": 64,
            "width": 64,
            "num_steps": 5,
            "seed": 7,
        }
        fields.update(kw)
        return build_request(**fields)

    return make
