"""What the scheduler's other-seed exact hits rest on (``chorus_sched.exact``): on the trained toy model, a Stage-1
donor with the very same prompt and settings gives back the donor's video bit for bit, whatever the plan's k1 and
with the donor check on — the steps computed after the switch point repeat the donor's own computation."""

from __future__ import annotations

import numpy as np
import pytest

from producer.contract import DonorVerification, GenerationRequest, ReusePlan, build_request
from workers.engine import Engine, load_bundle
from workers.toy import model as toy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (toy.WEIGHTS_DIR / toy.WEIGHTS_FILE).exists(), reason="no committed toy weights"),
]

PROMPT = "a green triangle moving up on a black background"


@pytest.fixture(scope="module")
def toy_engine() -> Engine:
    return Engine(load_bundle("toy"))


def _request(prompt: str, seed: int) -> GenerationRequest:
    return build_request(prompt=prompt, model="toy", num_steps=4, seed=seed)


@pytest.mark.parametrize("k1", [1, 2, 3])
def test_a_same_prompt_donor_gives_back_its_own_video_exactly(toy_engine: Engine, k1: int) -> None:
    donor = toy_engine.generate(_request(PROMPT, 5), ReusePlan.full(4))
    plan = ReusePlan(
        stage1_steps=k1, stage2_steps=0, stage3_steps=4 - k1, verification=DonorVerification(accept_max=1e-6)
    )
    out = toy_engine.generate(_request(PROMPT, 6), plan, donor=donor.trajectory)
    assert out.steps_computed == 4 - k1 and out.fallback is None  # it did reuse, and computed the rest
    assert np.array_equal(np.asarray(out.frames), np.asarray(donor.frames))
    # another prompt from the same donor latent is another video (the comparison can fail)
    other = toy_engine.generate(
        _request(PROMPT.replace("green", "red"), 6),
        plan.model_copy(update={"verification": None}),
        donor.trajectory,
    )
    assert not np.array_equal(np.asarray(other.frames), np.asarray(donor.frames))
