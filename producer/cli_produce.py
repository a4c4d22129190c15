"""``chorus produce``: publish one request or a JSONL batch, optionally wait for the results.

Validation comes first and is all-or-nothing: if any line of ``--file`` breaks the contract, every bad line is
reported (``line N: field: message [rule]``) and nothing is sent (exit 2), unless ``--skip-invalid`` is given, in
which case the valid lines go out and the bad ones are still reported. Field options (``--model``, ``--num-steps``
…) set one request's fields with ``--prompt``, and act as defaults for fields a ``--file`` line leaves out.

Exit codes: 0 everything sent (and, with ``--wait``, every result arrived with status ``done``); 1 a result
failed or did not arrive in time, or the broker refused a request; 2 invalid input (nothing sent).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from producer.catalog import ModelName
from producer.contract import ContractError, GenerationRequest, GenerationResult, ResultStatus, ReusePolicy
from producer.logs import configure_logging

if TYPE_CHECKING:
    from producer.settings import ProducerSettings

# Progress bars for batches at least this large.
_PROGRESS_MIN = 20


def produce(
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Prompt of one request."),
    file: Path | None = typer.Option(
        None, "--file", "-f", help="JSONL file of requests, one JSON object per line ('-' for stdin)."
    ),
    request_id: str | None = typer.Option(None, help="Request id (default: a new UUID). Not with --file."),
    tenant: str | None = typer.Option(None, help="Tenant (default 'default')."),
    negative_prompt: str | None = typer.Option(None, help="Negative prompt."),
    model: ModelName | None = typer.Option(None, help="Model from the catalog (default 'toy')."),
    num_frames: int | None = typer.Option(None, help="Frames (default: the model's)."),
    height: int | None = typer.Option(None, help="Height in pixels (default: the model's)."),
    width: int | None = typer.Option(None, help="Width in pixels (default: the model's)."),
    num_steps: int | None = typer.Option(None, help="Denoising steps (default: the model's)."),
    seed: int | None = typer.Option(None, help="Noise seed (default 0)."),
    guidance_scale: float | None = typer.Option(
        None, help="Classifier-free guidance scale (default: the model's)."
    ),
    reuse: ReusePolicy | None = typer.Option(None, help="Reuse policy: auto or off (default auto)."),
    keep_seed: bool | None = typer.Option(
        None,
        "--keep-seed/--any-seed",
        help="Reuse only donors grown from this request's own seed, so the video is that seed's sample "
        "(default: any seed).",
    ),
    priority: int | None = typer.Option(None, help="Priority 0..9 (default 0)."),
    wait: bool = typer.Option(False, "--wait", help="Follow the results topic until every result arrived."),
    timeout: float | None = typer.Option(
        None, help="Seconds to wait for results with --wait, more than 0 (default CHORUS_RESULT_TIMEOUT_S)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON document (for scripts) instead of tables."
    ),
    skip_invalid: bool = typer.Option(
        False, help="With --file: send the valid lines even if some are invalid."
    ),
    bootstrap: str | None = typer.Option(
        None, help="Kafka bootstrap servers (default CHORUS_KAFKA_BOOTSTRAP)."
    ),
    env_file: Path | None = typer.Option(
        None,
        "--env-file",
        help="Read CHORUS_* settings from this file (e.g. .chorus/stack.env of `chorus demo --keep-running`).",
    ),
) -> None:
    """Publish generation requests to the requests topic (and with --wait, print their results)."""
    from producer.settings import EnvFileMissing, ProducerSettings, use_env_file

    # Not a terminal (a pipe, a script): wide lines instead of a table folded to 80 columns.
    out = Console() if sys.stdout.isatty() else Console(width=200)
    err = Console(stderr=True)
    overrides: dict[str, Any] = {"kafka_bootstrap": bootstrap} if bootstrap else {}
    use_env_file(env_file)
    try:
        settings = ProducerSettings(**overrides)
    except EnvFileMissing as exc:
        _fail(err, str(exc))
    # Only warnings, on stderr: stdout carries the output (``--json``). kafka-python's own logs only with --debug:
    # an unreachable broker is reported in one line below.
    configure_logging("WARNING", settings.log_format, quiet_clients=True)

    if (prompt is None) == (file is None):
        _fail(err, "give exactly one of --prompt or --file")
    if timeout is not None and timeout <= 0:
        _fail(err, f"--timeout {timeout:g}: give the seconds to wait for results, more than 0")
    fields: dict[str, Any] = {
        "tenant": tenant,
        "negative_prompt": negative_prompt,
        "model": model,
        "num_frames": num_frames,
        "height": height,
        "width": width,
        "num_steps": num_steps,
        "seed": seed,
        "guidance_scale": guidance_scale,
        "reuse": reuse.value if reuse is not None else None,
        "keep_seed": keep_seed,
        "priority": priority,
    }
    requests, invalid = _requests_from(
        prompt, file, request_id, fields, skip_invalid=skip_invalid, as_json=as_json, out=out, err=err
    )
    sent, results = _publish_and_follow(settings, requests, wait, timeout, as_json=as_json, out=out, err=err)
    _report(
        settings.kafka_requests_topic,
        requests,
        sent,
        invalid,
        results,
        wait=wait,
        as_json=as_json,
        out=out,
        err=err,
    )


def _report(
    topic: str,
    requests: list[GenerationRequest],
    sent: list[str],
    invalid: list[Any],
    results: dict[str, GenerationResult],
    *,
    wait: bool,
    as_json: bool,
    out: Console,
    err: Console,
) -> None:
    """Print what was sent and what came back; exit 1 if a result is missing or not ``done``."""
    # Results are keyed by job id (tenant and request id): two tenants may send the same id in one file.
    missing = [r.request_id for r in requests if r.job_id not in results] if wait else []
    if as_json:
        doc = {
            "topic": topic,
            "sent": sent,
            "invalid": invalid,
            "results": [results[r.job_id].model_dump(mode="json") for r in requests if r.job_id in results],
            "missing": missing,
        }
        _print_json(doc)
    elif wait:
        out.print(_table(requests, results))
        if missing:
            err.print(
                f"[red]no result within the timeout for {len(missing)} request(s)[/]: {', '.join(missing)}"
            )
    failed = any(r.status is not ResultStatus.DONE for r in results.values())
    if missing or failed:
        raise typer.Exit(code=1)


def _requests_from(
    prompt: str | None,
    file: Path | None,
    request_id: str | None,
    fields: dict[str, Any],
    *,
    skip_invalid: bool,
    as_json: bool,
    out: Console,
    err: Console,
) -> tuple[list[GenerationRequest], list[str]]:
    """The requests to send (one from the options, or a file's lines) and the invalid lines skipped."""
    from producer.sdk import BatchInvalid, parse_jsonl, request_from_options

    if prompt is not None:
        try:
            return [request_from_options(prompt=prompt, request_id=request_id, **fields)], []
        except ContractError as exc:
            _fail(err, "invalid request:\n" + "\n".join(f"  {i}" for i in exc.issues))
    assert file is not None
    if request_id is not None:
        _fail(err, "--request-id names one request; put ids in the file's lines instead")
    batch = parse_jsonl(_read_lines(file, err), defaults={k: v for k, v in fields.items() if v is not None})
    invalid = [str(e) for e in batch.errors]
    if batch.errors and not skip_invalid:
        _fail(err, str(BatchInvalid(batch.errors)), as_json=as_json, out=out, invalid=invalid)
    for line in invalid:
        err.print(f"[yellow]skipped[/] {escape(line)}")
    requests = [r for _, r in batch.requests]
    if not requests:
        _fail(err, "no valid request to send", as_json=as_json, out=out, invalid=invalid)
    return requests, invalid


def _publish_and_follow(
    settings: ProducerSettings,
    requests: list[GenerationRequest],
    wait: bool,
    timeout: float | None,
    *,
    as_json: bool,
    out: Console,
    err: Console,
) -> tuple[list[str], dict[str, GenerationResult]]:
    """Publish the requests (the broker checked first) and, with ``wait``, collect their results."""
    from producer import bus
    from producer.sdk import ChorusClient, PublishError

    results: dict[str, GenerationResult] = {}
    bus.check_reachable(settings)  # BrokerUnreachable: one line from the CLI root, within seconds
    with ChorusClient(settings) as client:
        watcher = client.watch_results() if wait else None
        try:
            try:
                sent = _send(client, requests, err, quiet=as_json)
            except PublishError as exc:
                if exc.__cause__ is not None and bus.is_bootstrap_failure(exc.__cause__):
                    raise bus.BrokerUnreachable(settings.kafka_bootstrap, [str(exc.__cause__)]) from exc
                _fail(err, str(exc), code=1)
            if not as_json:
                for r in requests:
                    out.print(
                        f"sent [bold]{escape(r.request_id)}[/] → {escape(settings.kafka_requests_topic)}"
                    )
            if watcher is not None:
                limit = timeout if timeout is not None else settings.result_timeout_s
                results = _collect(watcher, requests, limit, err, quiet=as_json)
        finally:
            if watcher is not None:
                watcher.close()
    return sent, results


def _read_lines(file: Path, err: Console) -> list[bytes]:
    """The file's lines as bytes, split at line ends only: JSON strings may hold U+2028 and U+0085, which
    ``str.splitlines`` also splits at, and a line that is not UTF-8 is that line's error, not the file's."""
    try:
        data = sys.stdin.buffer.read() if str(file) == "-" else file.read_bytes()
    except OSError as exc:
        _fail(err, f"cannot read {file}: {exc}")
    # A bare CR can be a line end too: JSON allows no raw control character inside a string, so none is split.
    return re.split(rb"\r\n|\r|\n", data.removeprefix(b"\xef\xbb\xbf"))  # and a BOM is no content


def _send(client: Any, requests: list[GenerationRequest], err: Console, *, quiet: bool) -> list[str]:
    if len(requests) < _PROGRESS_MIN:
        ids: list[str] = client.submit_many(requests)
        return ids
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(
        TextColumn("sending"), BarColumn(), MofNCompleteColumn(), console=err, transient=True, disable=quiet
    ) as bar:
        task = bar.add_task("send", total=len(requests))
        ids = client.submit_many(requests, on_sent=lambda _key: bar.advance(task))
    return ids


def _collect(
    watcher: Any, requests: list[GenerationRequest], timeout_s: float, err: Console, *, quiet: bool
) -> dict[str, GenerationResult]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: dict[str, GenerationResult] = {}
    with Progress(
        TextColumn("waiting for results"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=quiet,
    ) as bar:
        task = bar.add_task("wait", total=len(requests))
        # The requests, not their ids: a result must match the tenant too (ids are per tenant).
        for result in watcher.wait(requests, timeout_s=timeout_s):
            results[result.job_id] = result
            bar.advance(task)
    return results


def _table(requests: list[GenerationRequest], results: dict[str, GenerationResult]) -> Table:
    table = Table(title="results")
    for column in (
        "request",
        "status",
        "reuse",
        "donor (sim)",
        "steps",
        "tokens",
        "fallback / error",
        "video",
        "s queue→upload",
    ):
        table.add_column(column, overflow="fold")
    for request in requests:
        r = results.get(request.job_id)
        name = (
            request.request_id if request.tenant == "default" else f"{request.request_id} ({request.tenant})"
        )
        if r is None:
            table.add_row(escape(name), "[red]no result[/]", *[""] * 7)
            continue
        status = "[green]done[/]" if r.status is ResultStatus.DONE else f"[red]{r.status}[/]"
        donor = f"{r.donor.request_id} ({r.donor.similarity:.2f})" if r.donor else "-"
        note = f"{r.error.code}: {r.error.message}" if r.error else (r.fallback or "")
        if not note and r.donor is not None and r.status is ResultStatus.DONE and not r.saved_compute:
            note = "planned donor saved nothing: its plan recomputed every token"
        if r.prompt_truncated:  # the video follows only the start of the prompt
            used = f" to {r.prompt_tokens_used} tokens" if r.prompt_tokens_used is not None else ""
            note = f"prompt truncated{used}" + (f"; {note}" if note else "")
        t = r.timings
        total = t.queue_s + t.fetch_s + t.denoise_s + t.decode_s + t.upload_s
        # What the video is, whether it is the requested seed's own sample (a Stage-1 donor of another seed
        # gives a valid video for the prompt, but not that one), and whether the id was answered before.
        reuse = str(r.reuse) + ("" if r.seed_honoured else ", donor's seed")
        reuse += ", answered before" if r.answers_resend and r.status is ResultStatus.DONE else ""
        table.add_row(
            escape(name),
            status,
            escape(reuse),
            escape(donor),
            f"{r.steps_computed}/{r.steps_requested}",
            f"{r.tokens_computed_fraction:.2f}",
            escape(note[:200]),
            escape(r.video_uri or "-"),
            f"{total:.2f}",
        )
    return table


def _print_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _fail(
    err: Console,
    message: str,
    *,
    code: int = 2,
    as_json: bool = False,
    out: Console | None = None,
    invalid: list[str] | None = None,
) -> NoReturn:
    if as_json and out is not None:
        _print_json({"error": message, "invalid": invalid or [], "sent": []})
    else:
        err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code=code)
