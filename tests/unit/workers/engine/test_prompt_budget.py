"""A prompt longer than the model's text token budget (issue 19): the engine warns with the counts, and the
result says how many tokens were used and that the prompt was cut."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from producer.contract import GenerationRequest, PhaseTimings, ReusePlan
from producer.orders import Role, WorkOrder
from workers.engine import Engine
from workers.results import done_result

# tiny-random-wan reads 16 text tokens: 15 words and its end token.
LONG = " ".join(f"word{i}" for i in range(40))


def test_a_long_prompt_is_cut_with_a_warning_and_the_counts(
    engine: Engine, make_request: Callable[..., GenerationRequest], caplog: pytest.LogCaptureFixture
) -> None:
    request = make_request(LONG, num_steps=3)
    with caplog.at_level(logging.WARNING, logger="workers.engine"):
        out = engine.generate(request, ReusePlan.full(3))
    assert out.prompt_truncated and out.prompt_tokens_used == 16
    [record] = [r for r in caplog.records if "truncated" in r.getMessage()]
    assert (record.prompt_tokens, record.tokens_used) == (41, 16)  # type: ignore[attr-defined]
    assert record.request_id == request.request_id  # type: ignore[attr-defined]
    assert out.summary()["prompt_truncated"] is True


def test_a_prompt_within_the_budget_is_whole(
    engine: Engine, make_request: Callable[..., GenerationRequest], caplog: pytest.LogCaptureFixture
) -> None:
    request = make_request("a red circle moving left", num_steps=3)
    with caplog.at_level(logging.WARNING, logger="workers.engine"):
        out = engine.generate(request, ReusePlan.full(3))
    assert not out.prompt_truncated and out.prompt_tokens_used == 6
    assert not [r for r in caplog.records if "truncated" in r.getMessage()]


def test_the_toy_encoder_counts_the_whole_prompt() -> None:
    from workers.toy.model import TEXT_LEN, encode_prompt

    long = encode_prompt("a red circle moving left on a white background " * 10)
    assert long.used_tokens == TEXT_LEN == 32 and long.prompt_tokens is not None and long.prompt_tokens > 32
    assert long.truncated
    short = encode_prompt("a red circle moving left")
    assert short.prompt_tokens == short.used_tokens and not short.truncated


def test_the_result_carries_the_counts(make_request: Callable[..., GenerationRequest]) -> None:
    request = make_request(LONG, num_steps=3)
    order = WorkOrder(request=request, plan=ReusePlan.full(3), donor=None, role=Role.SOLO)
    result = done_result(
        order,
        video_uri="s3://b/v.mp4",
        trajectory_uri=None,
        trajectory_bytes=0,
        steps_computed=3,
        tokens_computed_fraction=1.0,
        fallback=None,
        timings=PhaseTimings(),
        worker="w",
        noise_seed=request.seed,
        prompt_tokens_used=16,
        prompt_truncated=True,
    )
    again = type(result).model_validate_json(result.to_bytes())
    assert (again.prompt_tokens_used, again.prompt_truncated) == (16, True)
