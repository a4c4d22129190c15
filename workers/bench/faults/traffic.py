"""What the fault scenarios publish: valid toy requests and hostile messages of every kind the contract rejects.

A ``Message`` is raw Kafka key and value bytes (a value of None is a tombstone) with what the accounting needs to
know about it: the tenant and request id a reader can salvage from it (None when there is none) and whether it is
a valid request. Hostile messages use the default tenant (a salvaged tenant defaults to it) and ids of their own,
so a ``rejected`` answer to one is never mistaken for an answer to a valid request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import cycle

from producer.contract import DEFAULT_TENANT, build_request
from workers.toy.world import BG_COLORS, DIRECTIONS, FG_COLORS, SHAPES

MODEL = "toy"
STEPS = 4
BIG_PROMPT_CHARS = 1_000_000
HUGE_DIGITS = 5001


@dataclass(frozen=True)
class Message:
    key: bytes | None
    value: bytes | None
    tenant: str
    request_id: str | None
    valid: bool
    kind: str


def prompt(i: int) -> str:
    """The i-th toy prompt: colors vary fastest, so consecutive prompts are similar but not identical."""
    colors, backgrounds = list(FG_COLORS), list(BG_COLORS)
    color = colors[i % len(colors)]
    shape = SHAPES[(i // len(colors)) % len(SHAPES)]
    direction = DIRECTIONS[(i // 18) % len(DIRECTIONS)]
    background = backgrounds[(i // 72) % len(backgrounds)]
    return f"a {color} {shape} moving {direction} on a {background} background"


def valid(
    request_id: str, text: str, *, tenant: str = DEFAULT_TENANT, seed: int = 0, reuse: str = "auto"
) -> Message:
    """A valid toy request. Give each a seed of its own: an identical earlier request may be answered from its
    result without any work, which would hide the fault a scenario injects."""
    request = build_request(
        request_id=request_id,
        tenant=tenant,
        prompt=text,
        model=MODEL,
        num_steps=STEPS,
        seed=seed,
        reuse=reuse,
    )
    return Message(request_id.encode(), request.to_bytes(), tenant, request_id, True, "valid")


def _body(request_id: str | None, **fields: object) -> dict[str, object]:
    body: dict[str, object] = {"prompt": "a red circle moving left on a gray background", "model": MODEL}
    body["num_steps"] = STEPS
    if request_id is not None:
        body["request_id"] = request_id
    body.update(fields)
    return body


def _json(request_id: str | None, key: str | None = "", **fields: object) -> Message:
    """A JSON message keyed by its id (``key=""``), by ``key``, or unkeyed (``key=None``)."""
    kind = str(fields.pop("_kind"))
    raw = json.dumps(_body(request_id, **fields)).encode()
    key_bytes = None if key is None else (key or request_id or "").encode() or None
    return Message(key_bytes, raw, DEFAULT_TENANT, request_id, False, kind)


def _raw(kind: str, request_id: str, value: bytes | None) -> Message:
    # Unreadable as a request, so nothing names an id — except the key, which a reader may take as the id.
    return Message(request_id.encode(), value, DEFAULT_TENANT, request_id, False, kind)


def _huge_int(rid: str) -> Message:
    text = json.dumps(_body(rid))[:-1] + ', "seed": ' + "9" * HUGE_DIGITS + "}"
    return Message(rid.encode(), text.encode(), DEFAULT_TENANT, rid, False, "huge-int")


def _bad_id(rid: str) -> Message:
    # The id is outside the identifier alphabet; the key names the request, so a reader may answer under it.
    raw = json.dumps(_body("../" + rid)).encode()
    return Message(rid.encode(), raw, DEFAULT_TENANT, rid, False, "bad-id")


HOSTILE_KINDS: dict[str, Callable[[str], Message]] = {
    "tombstone": lambda rid: _raw("tombstone", rid, None),
    "not-json": lambda rid: _raw("not-json", rid, b'{"request_id": "' + rid.encode() + b'", prompt: oops'),
    "not-utf8": lambda rid: _raw("not-utf8", rid, b'{"prompt": "\xff\xfe caf\xe9"}'),
    "not-object": lambda rid: _raw("not-object", rid, b'["a red circle", 4]'),
    "deep-nesting": lambda rid: _raw("deep-nesting", rid, b"[" * 5000 + b"]" * 5000),
    "huge-int": _huge_int,
    "wrong-type": lambda rid: _json(rid, num_steps="4", seed="7", _kind="wrong-type"),
    "missing-id-no-key": lambda rid: _json(None, key=None, _kind="missing-id-no-key"),
    "key-mismatch": lambda rid: _json(rid, key=rid + "-other", _kind="key-mismatch"),
    "unknown-field": lambda rid: _json(rid, colour="red", _kind="unknown-field"),
    "unknown-model": lambda rid: _json(rid, model="sora-9000", _kind="unknown-model"),
    "schema-version": lambda rid: _json(rid, schema_version=2, _kind="schema-version"),
    "blank-prompt": lambda rid: _json(rid, prompt="   ", _kind="blank-prompt"),
    "bad-shape": lambda rid: _json(rid, height=48, _kind="bad-shape"),
    "negative-seed": lambda rid: _json(rid, seed=-1, _kind="negative-seed"),
    "bad-id": lambda rid: _bad_id(rid),
    "null-prompt": lambda rid: _json(rid, prompt=None, _kind="null-prompt"),
}


def big_prompt(rid: str) -> Message:
    return _json(rid, prompt="a red circle " * (BIG_PROMPT_CHARS // 13), _kind="big-prompt")


def hostile_stream(
    prefix: str, count: int, *, valid_every: int, big: int, seed_base: int = 0
) -> Iterator[Message]:
    """``count`` hostile messages cycling through every kind (``big`` of them 1 MB prompts, spread out), with a
    valid request (seed ``seed_base`` + its number) after every ``valid_every`` of them."""
    kinds = list(HOSTILE_KINDS)
    big_at = {round((j + 0.5) * count / big) for j in range(big)} if big else set()
    names = cycle(kinds)
    n_valid = 0
    for i in range(count):
        rid = f"{prefix}h{i}"
        yield big_prompt(rid) if i in big_at else HOSTILE_KINDS[next(names)](rid)
        if (i + 1) % valid_every == 0:
            yield valid(f"{prefix}v{n_valid}", prompt(n_valid), seed=seed_base + n_valid)
            n_valid += 1
