"""The producer SDK's batch validation (property-based) and ``chorus produce`` input errors (no broker)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from producer.cli import app
from producer.sdk import BatchInvalid, ChorusClient, parse_jsonl
from producer.settings import ProducerSettings

# Each invalid kind: (line text, the field the error must name, the rule it must name).
INVALID: dict[str, tuple[str, str, str]] = {
    "not_json": ('{"prompt": "a red', "<message>", "json"),
    "array": ('["a", "b"]', "<message>", "object"),
    "no_prompt": ('{"model": "toy"}', "prompt", "missing"),
    "blank_prompt": ('{"prompt": "   "}', "prompt", "blank"),
    "bad_height": ('{"prompt": "x", "model": "toy", "height": 48}', "height", "model_shape"),
    "unknown_model": ('{"prompt": "x", "model": "sora"}', "model", "unknown_model"),
    "extra_field": ('{"prompt": "x", "colour": "red"}', "colour", "extra_forbidden"),
    "bad_seed": ('{"prompt": "x", "seed": -1}', "seed", "greater_than_equal"),
    "bad_version": ('{"prompt": "x", "schema_version": 2}', "schema_version", "schema_version"),
}

words = st.text(alphabet="abcdefghij klmnop", min_size=1, max_size=30).filter(lambda s: s.strip())
valid_line = st.fixed_dictionaries(
    {"prompt": words, "seed": st.integers(min_value=0, max_value=2**40)},
    optional={
        "model": st.sampled_from(["toy", "tiny-random-wan"]),
        "tenant": st.sampled_from(["acme", "default", "t-2"]),
        "reuse": st.sampled_from(["auto", "off"]),
        "priority": st.integers(min_value=0, max_value=9),
    },
)
line_kind = st.one_of(
    st.tuples(st.just("valid"), valid_line),
    st.tuples(st.just("invalid"), st.sampled_from(sorted(INVALID))),
    st.tuples(st.just("blank"), st.sampled_from(["", "   ", "\t"])),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(line_kind, max_size=25))
def test_every_bad_line_is_reported_by_number_and_every_good_line_parses(
    kinds: list[tuple[str, Any]],
) -> None:
    lines: list[str] = []
    expected_valid: dict[int, dict[str, Any]] = {}
    expected_invalid: dict[int, tuple[str, str]] = {}
    for number, (kind, payload) in enumerate(kinds, start=1):
        if kind == "valid":
            data = {**payload, "request_id": f"r-{number}"}
            lines.append(json.dumps(data))
            expected_valid[number] = data
        elif kind == "invalid":
            text, field, rule = INVALID[payload]
            lines.append(text)
            expected_invalid[number] = (field, rule)
        else:
            lines.append(payload)

    batch = parse_jsonl(lines)

    assert [n for n, _ in batch.requests] == sorted(expected_valid)
    for number, request in batch.requests:
        source = expected_valid[number]
        for key, value in source.items():
            assert getattr(request, key) == value
    assert [e.line for e in batch.errors] == sorted(expected_invalid)
    for error in batch.errors:
        field, rule = expected_invalid[error.line]
        assert any(i.field == field and i.rule == rule for i in error.issues), error
        assert str(error).startswith(f"line {error.line}: ")
    assert batch.ok == (not expected_invalid)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=12))
def test_a_repeated_request_id_is_an_error_on_the_later_line(ids: list[str]) -> None:
    lines = [json.dumps({"prompt": "x", "request_id": rid}) for rid in ids]
    batch = parse_jsonl(lines)
    first: dict[str, int] = {}
    for number, rid in enumerate(ids, start=1):
        first.setdefault(rid, number)
    assert [n for n, _ in batch.requests] == sorted(first.values())
    duplicates = [n for n, rid in enumerate(ids, start=1) if first[rid] != n]
    assert [e.line for e in batch.errors] == duplicates
    for error in batch.errors:
        assert error.issues[0].rule == "duplicate"
        assert f"line {first[ids[error.line - 1]]}" in error.issues[0].message


def test_one_request_id_may_be_used_by_two_tenants_but_not_twice_by_one() -> None:
    lines = [
        json.dumps({"prompt": "x", "request_id": "same"}),
        json.dumps({"prompt": "x", "request_id": "same", "tenant": "acme"}),
        json.dumps({"prompt": "y", "request_id": "same", "tenant": "acme"}),
    ]
    batch = parse_jsonl(lines)
    assert [(n, r.tenant) for n, r in batch.requests] == [(1, "default"), (2, "acme")]
    [error] = batch.errors
    assert error.line == 3 and "for tenant 'acme' on line 2" in error.issues[0].message


def test_defaults_fill_only_what_a_line_leaves_out() -> None:
    lines = [
        json.dumps({"prompt": "one"}),
        json.dumps({"prompt": "two", "model": "toy", "num_steps": 6}),
        "[1]",
    ]
    batch = parse_jsonl(lines, defaults={"model": "tiny-random-wan", "num_steps": 3, "tenant": "acme"})
    (_, first), (_, second) = batch.requests
    assert (first.model, first.num_steps, first.tenant) == ("tiny-random-wan", 3, "acme")
    assert (second.model, second.num_steps, second.tenant) == ("toy", 6, "acme")
    assert [(e.line, e.issues[0].rule) for e in batch.errors] == [(3, "object")]


def test_an_invalid_batch_is_refused_before_anything_is_sent() -> None:
    batch = parse_jsonl(['{"prompt": "ok"}', "nope"])
    # The client never connects: the bootstrap address is unreachable on purpose.
    client = ChorusClient(ProducerSettings(kafka_bootstrap="127.0.0.1:1"))
    try:
        client.submit_batch(batch)
    except BatchInvalid as exc:
        assert [e.line for e in exc.errors] == [2]
        assert "nothing was sent" in str(exc)
    else:
        raise AssertionError("an invalid batch was accepted")
    assert client._producer is None


def test_produce_reports_bad_lines_and_sends_nothing(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_text('{"prompt": "fine"}\n\n{"prompt": "x", "model": "toy", "height": 48}\n{"oops"\n')
    runner = CliRunner()
    result = runner.invoke(app, ["produce", "--file", str(path), "--bootstrap", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "2 invalid line(s); nothing was sent" in result.output
    assert "line 3: height: must be 32 for model 'toy' (got 48) [model_shape]" in result.output
    assert "line 4: <message>: not JSON" in result.output

    as_json = runner.invoke(app, ["produce", "--file", str(path), "--json", "--bootstrap", "127.0.0.1:1"])
    assert as_json.exit_code == 2
    doc = json.loads(as_json.stdout)
    assert doc["sent"] == [] and [line.split(":")[0] for line in doc["invalid"]] == ["line 3", "line 4"]


def test_a_batch_file_splits_at_newlines_only_and_a_line_not_utf8_is_that_lines_error(tmp_path: Path) -> None:
    # JSON strings may hold U+2028 and U+0085 unescaped (json.dumps(ensure_ascii=False) writes them);
    # str.splitlines split the first line in three and numbered the rest wrongly.
    path = tmp_path / "batch.jsonl"
    lines = [
        json.dumps({"prompt": "a red circle\u2028on black\u0085slowly"}, ensure_ascii=False).encode(),
        b'{"prompt": "caf\xff"}',  # not UTF-8
        json.dumps({"prompt": "a blue square"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    runner = CliRunner()
    # with defaults the lines are parsed by another path; "-" reads standard input
    for source, extra in ((str(path), []), (str(path), ["--model", "toy"]), ("-", [])):
        result = runner.invoke(
            app,
            ["produce", "--file", source, "--bootstrap", "127.0.0.1:1", *extra],
            input=path.read_bytes() if source == "-" else None,
        )
        assert result.exit_code == 2, result.output
        assert "1 invalid line(s); nothing was sent" in result.output
        assert "line 2: <message>: not UTF-8 at byte 15 [utf8]" in result.output


def test_a_batch_file_with_other_line_ends_a_bom_or_blank_unicode_lines_reads_as_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "batch.jsonl"
    # a BOM (PowerShell writes one), CRLF and bare CR line ends, and a line of a no-break space only
    body = '{"prompt": "one"}\r\n{"prompt": "two"}\r{"prompt": "three"}\n\u00a0\n'
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    result = CliRunner().invoke(app, ["produce", "--file", str(path), "--bootstrap", "127.0.0.1:1"])
    # every line valid: it got as far as sending (to a broker that is not there on purpose)
    assert result.exit_code == 1 and "cannot reach the Kafka broker" in result.output, result.output
    assert "invalid line" not in result.output


def test_produce_rejects_conflicting_or_invalid_options(tmp_path: Path) -> None:
    runner = CliRunner()
    both = runner.invoke(app, ["produce", "--prompt", "x", "--file", str(tmp_path / "f")])
    assert both.exit_code == 2 and "exactly one of --prompt or --file" in both.output
    negative = runner.invoke(app, ["produce", "--prompt", "x", "--wait", "--timeout", "-5"])
    assert negative.exit_code == 2 and "--timeout" in negative.output  # refused before anything is sent
    bad = runner.invoke(app, ["produce", "--prompt", "x", "--model", "toy", "--num-frames", "9"])
    assert bad.exit_code == 2 and "num_frames: must be 8 for model 'toy' (got 9) [model_shape]" in bad.output


def test_the_results_table_says_what_each_video_is() -> None:
    from rich.console import Console

    from producer.cli_produce import _table
    from producer.contract import GenerationResult, ResultStatus, ReuseKind, build_request

    requests = [build_request(request_id=f"r{i}", prompt="a red circle", model="toy") for i in range(3)]
    done = {"status": ResultStatus.DONE, "steps_requested": 4, "video_uri": "s3://b/v"}
    results = {
        "r0": GenerationResult(request_id="r0", reuse=ReuseKind.STAGE1, seed_honoured=False, **done),
        "r1": GenerationResult(request_id="r1", reuse=ReuseKind.EXACT, answers_resend=True, **done),
    }
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(_table(requests, results))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if "│" in line}
    assert "stage1, donor's seed" in rows["r0"]  # a valid video for the prompt, not the requested seed's own
    assert "exact, answered before" in rows["r1"] and "donor's seed" not in rows["r1"]
    assert "no result" in rows["r2"]
