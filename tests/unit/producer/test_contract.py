from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.catalog import CATALOG, IntRule
from producer.contract import (
    ContractError,
    DeadLetter,
    DonorInfo,
    ErrorInfo,
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    ReusePlan,
    build_request,
    job_id,
    split_job_id,
)
from producer.parsing import parse_keyed_request, parse_request, salvage_identity, salvage_json

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "schema_version", "request_id", "tenant", "prompt", "negative_prompt", "model", "num_frames", "height",
    "width", "num_steps", "seed", "guidance_scale", "reuse", "priority", "submitted_at",
]  # fmt: skip


def issues_of(raw: bytes | str) -> list[tuple[str, str]]:
    with pytest.raises(ContractError) as excinfo:
        parse_request(raw)
    return [(i.field, i.rule) for i in excinfo.value.issues]


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_as_anything_but_contract_error(raw: bytes) -> None:
    try:
        parse_request(raw)
    except ContractError as exc:
        assert exc.issues and all(i.field and i.rule and i.message for i in exc.issues)


@given(json_values)
def test_arbitrary_json_is_accepted_or_rejected_precisely(value: Any) -> None:
    try:
        request = parse_request(json.dumps(value))
    except ContractError as exc:
        assert all(i.field and i.rule for i in exc.issues)
    else:
        assert isinstance(value, dict) and request.prompt == value["prompt"]


valid_toy_requests = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=2000).filter(str.strip)},
    optional={
        "request_id": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,40}", fullmatch=True),
        "tenant": st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
        "negative_prompt": st.none() | st.text(max_size=100),
        "num_steps": st.integers(1, 200),
        "seed": st.integers(0, 2**63 - 1),
        "guidance_scale": st.floats(0, 50),
        "reuse": st.sampled_from(["auto", "off"]),
        "priority": st.integers(0, 9),
    },
)


@given(valid_toy_requests)
def test_valid_requests_round_trip_through_the_wire(fields: dict[str, Any]) -> None:
    request = parse_request(json.dumps(fields).encode())
    assert parse_request(request.to_bytes()) == request
    for name, value in fields.items():
        if value is not None:
            assert getattr(request, name) == value


@settings(max_examples=200)
@given(valid_toy_requests, st.sampled_from(FIELDS), json_values)
def test_one_corrupted_field_is_named_in_the_error(fields: dict[str, Any], name: str, value: Any) -> None:
    corrupted = {**fields, name: value}
    try:
        parse_request(json.dumps(corrupted))
    except ContractError as exc:
        assert name in {i.field for i in exc.issues}, exc.issues


def test_defaults_come_from_the_model() -> None:
    request = build_request(prompt="a red circle moving left", model="wan2.1-t2v-1.3b")
    spec = CATALOG["wan2.1-t2v-1.3b"]
    assert (request.num_frames, request.height, request.width) == (
        spec.default_num_frames,
        spec.default_height,
        spec.default_width,
    )
    assert (
        request.num_steps == spec.default_num_steps and request.guidance_scale == spec.default_guidance_scale
    )
    assert request.request_id and request.submitted_at.tzinfo is not None


@pytest.mark.parametrize(
    ("raw", "field", "rule"),
    [
        (b"\xff\xfe", "<message>", "utf8"),
        (b"{not json", "<message>", "json"),
        (b"[]", "<message>", "object"),
        (b'{"schema_version": 2, "prompt": "x"}', "schema_version", "schema_version"),
        (b"{}", "prompt", "missing"),
        (b'{"prompt": ""}', "prompt", "string_too_short"),
        (b'{"prompt": "   "}', "prompt", "blank"),
        (json.dumps({"prompt": "x" * 2001}).encode(), "prompt", "string_too_long"),
        (b'{"prompt": "x", "model": "sora"}', "model", "unknown_model"),
        (b'{"prompt": "x", "height": 64}', "height", "model_shape"),
        (b'{"prompt": "x", "model": "wan2.1-t2v-1.3b", "num_frames": 32}', "num_frames", "model_shape"),
        (b'{"prompt": "x", "model": "wan2.1-t2v-1.3b", "width": 500}', "width", "model_shape"),
        (b'{"prompt": "x", "num_steps": 0}', "num_steps", "greater_than_equal"),
        (b'{"prompt": "x", "seed": -1}', "seed", "greater_than_equal"),
        (b'{"prompt": "x", "guidance_scale": "high"}', "guidance_scale", "float_type"),
        (b'{"prompt": "x", "num_steps": "4"}', "num_steps", "int_type"),
        (b'{"prompt": "x", "seed": "7"}', "seed", "int_type"),
        (b'{"prompt": "x", "priority": true}', "priority", "int_type"),
        (b'{"prompt": "x", "guidance_scale": "2.5"}', "guidance_scale", "float_type"),
        (b'{"prompt": "x", "seed": ' + b"9" * 5001 + b"}", "<message>", "json"),
        (b'{"prompt": "' + b"x" * (1 << 20) + b'"}', "<message>", "size"),
        (b'{"prompt": "x", "reuse": "sometimes"}', "reuse", "enum"),
        (b'{"prompt": "x", "request_id": "../etc/passwd"}', "request_id", "string_pattern_mismatch"),
        (b'{"prompt": "x", "colour": "red"}', "colour", "extra_forbidden"),
        (b'{"prompt": "x", "submitted_at": "2026-01-01T00:00:00"}', "submitted_at", "timezone_aware"),
    ],
)
def test_violations_name_the_field_and_the_rule(raw: bytes, field: str, rule: str) -> None:
    assert (field, rule) in issues_of(raw)


def test_a_tombstone_is_a_contract_error_not_a_crash() -> None:
    with pytest.raises(ContractError) as excinfo:
        parse_request(None)
    assert [(i.field, i.rule) for i in excinfo.value.issues] == [("<message>", "tombstone")]
    with pytest.raises(ContractError, match="tombstone"):
        parse_keyed_request(None, b"r-1")


def test_a_float_field_takes_an_integer() -> None:
    assert parse_request(b'{"prompt": "x", "guidance_scale": 2}').guidance_scale == 2.0


@pytest.mark.parametrize(
    ("doc", "key", "outcome"),
    [
        ({"prompt": "x", "request_id": "r-1"}, b"r-1", "r-1"),
        ({"prompt": "x", "request_id": "r-1"}, None, "r-1"),
        ({"prompt": "x"}, b"r-9", "r-9"),
        ({"prompt": "x"}, None, ("request_id", "missing")),
        ({"prompt": "x", "request_id": "r-1"}, b"r-2", ("<key>", "key_mismatch")),
        ({"prompt": "x"}, b"../bad", ("request_id", "string_pattern_mismatch")),
    ],
)
def test_a_keyed_request_is_always_one_its_sender_can_find(
    doc: dict[str, Any], key: bytes | None, outcome: str | tuple[str, str]
) -> None:
    if isinstance(outcome, str):
        assert parse_keyed_request(json.dumps(doc), key).request_id == outcome
    else:
        with pytest.raises(ContractError) as excinfo:
            parse_keyed_request(json.dumps(doc), key)
        assert outcome in [(i.field, i.rule) for i in excinfo.value.issues]


@given(st.binary(max_size=200) | st.none(), st.binary(max_size=40) | st.none())
def test_keyed_parsing_never_escapes_as_anything_but_contract_error(
    raw: bytes | None, key: bytes | None
) -> None:
    try:
        request = parse_keyed_request(raw, key)
    except ContractError as exc:
        assert exc.issues and all(i.field and i.rule and i.message for i in exc.issues)
    else:
        assert key is None or request.request_id == key.decode()


def test_a_huge_message_is_dead_lettered_within_a_bounded_size() -> None:
    raw = json.dumps({"prompt": "x" * (1 << 20), "request_id": "big"}).encode()
    letter = DeadLetter.of_message(
        raw,
        b"big",
        ErrorInfo(code="invalid_request", message="too big"),
        [],
        topic="t",
        partition=0,
        offset=3,
    )
    assert len(letter.to_bytes()) < 64 * 1024
    assert letter.raw_truncated and letter.raw_size == len(raw) and letter.raw() == raw[: len(letter.raw())]
    assert letter.raw_sha256 == hashlib.sha256(raw).hexdigest()
    tomb = DeadLetter.of_message(
        None,
        b"k",
        ErrorInfo(code="invalid_request", message="tombstone"),
        [],
        topic="t",
        partition=0,
        offset=4,
    )
    assert tomb.tombstone and tomb.raw() == b"" and not tomb.raw_truncated


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"request_id": "r-1", "tenant": "acme"}, ("r-1", "acme")),
        ({"request_id": "r-1"}, ("r-1", "default")),
        ({"request_id": "../x", "tenant": "a b"}, (None, "default")),
        ({"request_id": 5, "tenant": None}, (None, "default")),
        ([1, 2], (None, "default")),
        (None, (None, "default")),
    ],
)
def test_one_salvage_rule_keeps_only_valid_identifiers(data: Any, expected: tuple[str | None, str]) -> None:
    assert salvage_identity(data) == expected


def test_salvaging_json_is_bounded_like_parsing() -> None:
    assert salvage_json(b'{"seed": ' + b"9" * 5001 + b"}") is None
    assert salvage_json(None) is None
    assert salvage_json(b'{"request_id": "r"}') == {"request_id": "r"}


def test_error_message_is_readable() -> None:
    with pytest.raises(ContractError) as excinfo:
        parse_request(b'{"prompt": "x", "model": "wan2.1-t2v-1.3b", "num_frames": 32}')
    assert (
        str(excinfo.value) == "num_frames: must be 4·k+1 for model 'wan2.1-t2v-1.3b' (got 32) [model_shape]"
    )


@given(st.integers(-5, 300), st.integers(1, 8), st.integers(0, 7))
def test_int_rule_accepts_exactly_its_values(value: int, modulus: int, remainder: int) -> None:
    rule = IntRule(minimum=1, maximum=121, modulus=modulus, remainder=remainder % modulus)
    assert (rule.check(value) is None) == (1 <= value <= 121 and value % modulus == remainder % modulus)


def test_plan_and_result_and_dead_letter_round_trip() -> None:
    plan = ReusePlan(stage1_steps=1, stage2_steps=2, stage3_steps=1, alpha=2.0)
    assert plan.num_steps == 4 and plan.reuses and not ReusePlan.full(4).reuses
    with pytest.raises(ValueError, match="min_active_fraction"):
        ReusePlan(
            stage1_steps=0, stage2_steps=0, stage3_steps=4, min_active_fraction=0.9, max_active_fraction=0.5
        )
    result = GenerationResult(request_id="r", status=ResultStatus.DONE, plan=plan, steps_computed=3)
    assert GenerationResult.model_validate_json(result.to_bytes()) == result

    raw = b'{"prompt": 5}'
    with pytest.raises(ContractError) as excinfo:
        parse_request(raw)
    letter = DeadLetter.from_error(raw, b"k", excinfo.value, "requests", 2, 17)
    back = DeadLetter.model_validate_json(letter.to_bytes())
    assert back.raw() == raw and back.partition == 2 and back.offset == 17
    assert back.issues[0].field == "prompt" and back.error.code == "invalid_request"


def test_a_result_from_a_newer_worker_is_still_read() -> None:
    # A field added in a later release must not make an older reader drop the result (rolling upgrades).
    result = GenerationResult(request_id="r", status=ResultStatus.DONE, steps_computed=3)
    doc = json.loads(result.to_bytes())
    doc["added_in_a_later_release"] = {"x": 1}
    assert GenerationResult.model_validate_json(json.dumps(doc)) == result
    # Requests stay strict: a misspelled field is reported, not ignored.
    with pytest.raises(ContractError, match="extra_forbidden"):
        parse_request(b'{"prompt": "x", "sead": 3}')


def test_request_is_immutable() -> None:
    request = build_request(prompt="x")
    with pytest.raises(ValueError):
        request.prompt = "y"  # type: ignore[misc]
    assert isinstance(request, GenerationRequest)


@given(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,20}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,20}", fullmatch=True),
)
def test_a_job_id_names_one_tenant_and_request_and_splits_back(tenant: str, request_id: str) -> None:
    job = job_id(tenant, request_id)
    assert split_job_id(job) == (tenant, request_id)
    assert (job == request_id) == (tenant == "default")
    assert DonorInfo.of_job(job, 0.5).job_id == job
