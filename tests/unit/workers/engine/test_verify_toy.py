"""Donor verification on the trained toy model: the signal separates what the model draws differently (a colour
word) from what it draws alike (a paraphrase, the same prompt), and a threshold below the signal stops the reuse."""

from __future__ import annotations

import pytest

from producer.contract import DonorVerification, GenerationRequest, ReusePlan, build_request
from workers.engine import Engine, GenerationOutput, load_bundle
from workers.engine.fallback import FallbackCause
from workers.toy import model as toy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (toy.WEIGHTS_DIR / toy.WEIGHTS_FILE).exists(), reason="no committed toy weights"),
]

BASE = "a red circle moving left on a white background"
COLOUR = "a blue circle moving left on a white background"
PARAPHRASE = "a red circle that moves to the left on a white background"
SEEDS = (1, 2)
MEASURE = DonorVerification(accept_max=1e9)  # accept everything: only the signal is wanted


@pytest.fixture(scope="module")
def toy_engine() -> Engine:
    return Engine(load_bundle("toy"))


def _request(prompt: str, seed: int) -> GenerationRequest:
    return build_request(prompt=prompt, model="toy", num_steps=4, seed=seed)  # catalog default guidance (CFG)


def _reuse(engine: Engine, prompt: str, seed: int, policy: DonorVerification) -> GenerationOutput:
    donor = engine.generate(_request(BASE, seed), ReusePlan.full(4))
    plan = ReusePlan(stage1_steps=2, stage2_steps=0, stage3_steps=2, verification=policy)
    return engine.generate(_request(prompt, seed + 100), plan, donor=donor.trajectory)


def _signal(engine: Engine, prompt: str) -> float:
    signals = []
    for seed in SEEDS:
        report = _reuse(engine, prompt, seed, MEASURE).verification
        assert report is not None and report.signal is not None
        signals.append(report.signal)
    return sum(signals) / len(signals)


def test_identical_prompt_is_accepted_with_no_signal(toy_engine: Engine) -> None:
    out = _reuse(toy_engine, BASE, 1, DonorVerification(accept_max=1e-6))
    assert out.verification is not None and out.verification.decision == "accepted"
    assert out.verification.signal is not None and out.verification.signal < 1e-9
    assert out.steps_computed == 2 and out.fallback is None


def test_a_changed_colour_signals_more_than_a_paraphrase(toy_engine: Engine) -> None:
    colour, paraphrase = _signal(toy_engine, COLOUR), _signal(toy_engine, PARAPHRASE)
    assert colour > 2 * paraphrase > 0


def test_a_threshold_below_the_signal_shortens_or_rejects(toy_engine: Engine) -> None:
    signal = _signal(toy_engine, COLOUR)
    shortened = _reuse(toy_engine, COLOUR, SEEDS[0], DonorVerification(accept_max=0.0, shorten_max=1e9))
    assert shortened.verification is not None and shortened.verification.decision == "shortened"
    assert shortened.verification.stage1_steps == 1 and shortened.steps_computed == 3
    assert shortened.fallback_cause is FallbackCause.VERIFICATION_SHORTENED
    rejected = _reuse(toy_engine, COLOUR, SEEDS[0], DonorVerification(accept_max=signal / 100))
    assert rejected.verification is not None and rejected.verification.decision == "rejected"
    assert rejected.steps_computed == 4 and rejected.tokens_computed_fraction == 1.0
    assert rejected.verification.wasted_tokens_fraction == 1.0  # the thrown-away pass was a full step
    assert rejected.fallback is not None and "donor rejected" in rejected.fallback
