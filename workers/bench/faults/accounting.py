"""What a fault scenario sent and what came back, counted: a pure function of three lists.

``account`` matches every result read from the results topic to the request it answers by ``(tenant,
request_id)`` and every dead letter to the message it reports by ``(partition, offset)`` on the requests topic,
and counts, for the valid requests: done, failed, rejected (by their first result, what a client sees), lost (no
result of any kind), duplicated (more than one result for one ``(tenant, request_id)``; an answer to a message that
sent the id again, ``answers_resend``, is not one), wrong_tenant (a result
whose ``(tenant, request_id)`` matches none sent while its request id is another tenant's), shared_video (two
requests answered with the same video); for the hostile messages: dead-lettered, dead-lettered with the field and
rule they broke, answered ``rejected``, executed (answered ``done``: must never happen). ``judge`` turns a tally
into ``ok`` and the reasons it is not.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

Key = tuple[str, str]  # (tenant, request_id)


@dataclass(frozen=True)
class Sent:
    """One message published to the requests topic."""

    tenant: str
    request_id: str | None
    valid: bool
    kind: str = "valid"
    partition: int = -1
    offset: int = -1
    sent_at: float = 0.0

    @property
    def key(self) -> Key | None:
        return None if self.request_id is None else (self.tenant, self.request_id)


@dataclass(frozen=True)
class Received:
    """One result read from the results topic."""

    tenant: str
    request_id: str
    status: str
    arrived_at: float = 0.0
    video_uri: str | None = None
    error_code: str | None = None
    donor: str | None = None  # the donor the scheduler planned
    fallback: str | None = None  # why the worker did not use it
    trajectory_uri: str | None = None
    # An answer to a message that sent the id again (a producer's retry during a fault): not a second result.
    answers_resend: bool = False

    @property
    def key(self) -> Key:
        return (self.tenant, self.request_id)


@dataclass(frozen=True)
class Letter:
    """One dead letter read from the dead-letter topic: where the message it reports was, and why."""

    partition: int
    offset: int
    code: str
    issues: tuple[tuple[str, str], ...] = ()  # (field, rule)
    arrived_at: float = 0.0


@dataclass
class HostileTally:
    sent: int = 0
    dead_lettered: int = 0
    with_field_and_rule: int = 0
    rejected_results: int = 0
    executed: int = 0
    letters_duplicated: int = 0
    unanswered_by_kind: dict[str, int] = field(default_factory=dict)
    rules: dict[str, int] = field(default_factory=dict)

    @property
    def unanswered(self) -> int:
        return sum(self.unanswered_by_kind.values())


@dataclass
class Tally:
    sent: int = 0
    valid: int = 0
    done: int = 0
    failed: int = 0
    rejected: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong_tenant: int = 0
    shared_video: int = 0
    unexpected: int = 0
    recover_s: float | None = None
    hostile: HostileTally = field(default_factory=HostileTally)
    lost_ids: list[str] = field(default_factory=list)
    failures: list[dict[str, str | None]] = field(default_factory=list)


def account(
    sent: Iterable[Sent],
    results: Iterable[Received],
    letters: Iterable[Letter],
    *,
    fault_end: float | None = None,
) -> Tally:
    """Count what ``sent`` got back in ``results`` and ``letters`` (already cut at the scenario's deadline).

    ``results`` may hold results of other scenarios' requests: only those whose request id was sent here count
    (as matches, duplicates, or wrong-tenant deliveries). ``recover_s`` is the time from ``fault_end`` to the
    first result at or after it, if both exist.
    """
    sent = list(sent)
    ours = {s.request_id for s in sent if s.request_id is not None}
    by_key: dict[Key, list[Received]] = defaultdict(list)
    for r in sorted(results, key=lambda r: r.arrived_at):
        if r.request_id in ours and not r.answers_resend:
            by_key[r.key].append(r)
    tally = Tally(sent=len(sent))
    _count_valid(tally, [s for s in sent if s.valid], by_key)
    sent_keys = {s.key for s in sent if s.key is not None}
    tally.duplicated = sum(len(rs) - 1 for key, rs in by_key.items() if key in sent_keys and len(rs) > 1)
    strays = [key for key in by_key if key not in sent_keys]
    tally.wrong_tenant = sum(len(by_key[key]) for key in strays)
    tally.shared_video = _shared_videos(by_key)
    tally.hostile = _count_hostile([s for s in sent if not s.valid], by_key, letters)
    tally.recover_s = _recovery(by_key, fault_end)
    return tally


def _count_valid(tally: Tally, valid: list[Sent], by_key: dict[Key, list[Received]]) -> None:
    tally.valid = len(valid)
    for s in valid:
        assert s.key is not None, "a valid request has an id"
        got = by_key.get(s.key)
        if not got:
            tally.lost += 1
            tally.lost_ids.append(_name(s.key))
            continue
        first = got[0]
        if first.status == "done":
            tally.done += 1
            continue
        if first.status == "failed":
            tally.failed += 1
        elif first.status == "rejected":
            tally.rejected += 1
        else:
            tally.unexpected += 1
        tally.failures.append({"request": _name(s.key), "status": first.status, "code": first.error_code})


def _shared_videos(by_key: dict[Key, list[Received]]) -> int:
    """Results of different requests that name the same video (one request's video delivered to another)."""
    owners: dict[str, set[Key]] = defaultdict(set)
    for key, rs in by_key.items():
        for r in rs:
            if r.video_uri:
                owners[r.video_uri].add(key)
    return sum(len(keys) - 1 for keys in owners.values() if len(keys) > 1)


def _count_hostile(
    hostile: list[Sent], by_key: dict[Key, list[Received]], letters: Iterable[Letter]
) -> HostileTally:
    at: dict[tuple[int, int], list[Letter]] = defaultdict(list)
    for letter in letters:
        at[(letter.partition, letter.offset)].append(letter)
    out = HostileTally(sent=len(hostile))
    unanswered: Counter[str] = Counter()
    rules: Counter[str] = Counter()
    for s in hostile:
        found = at.get((s.partition, s.offset), [])
        got = by_key.get(s.key, []) if s.key is not None else []
        if found:
            out.dead_lettered += 1
            out.letters_duplicated += len(found) - 1
            issues = [(f, r) for letter in found for f, r in letter.issues if f and r]
            out.with_field_and_rule += bool(issues)
            rules.update(f"{s.kind}: {f} [{r}]" for f, r in issues[:1])
        else:
            unanswered[s.kind] += 1
        out.rejected_results += any(r.status == "rejected" for r in got)
        out.executed += any(r.status == "done" for r in got)
    out.unanswered_by_kind = dict(sorted(unanswered.items()))
    out.rules = dict(sorted(rules.items()))
    return out


def _recovery(by_key: dict[Key, list[Received]], fault_end: float | None) -> float | None:
    if fault_end is None:
        return None
    after = [r.arrived_at for rs in by_key.values() for r in rs if r.arrived_at >= fault_end]
    return round(min(after) - fault_end, 3) if after else None


def _name(key: Key) -> str:
    tenant, request_id = key
    return f"{tenant}/{request_id}"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reasons: tuple[str, ...]


def judge(
    tally: Tally,
    *,
    scheduler_crashes: int = 0,
    scheduler_alive: bool = True,
    allowed_failures: int = 0,
    checks: dict[str, bool] | None = None,
) -> Verdict:
    """The issue's done criteria: nothing lost, duplicated or delivered to another tenant; every valid request
    done (``allowed_failures`` where the fault makes success impossible); every hostile message dead-lettered with
    its field and rule and none executed; the scheduler never crashed and is alive; every scenario check held."""
    reasons: list[str] = []
    for what, count in (
        ("lost", tally.lost),
        ("duplicated", tally.duplicated),
        ("wrong_tenant", tally.wrong_tenant),
        ("shared_video", tally.shared_video),
        ("scheduler_crashes", scheduler_crashes),
        ("hostile executed", tally.hostile.executed),
        ("hostile not dead-lettered", tally.hostile.unanswered),
        (
            "hostile dead-lettered without field and rule",
            tally.hostile.dead_lettered - tally.hostile.with_field_and_rule,
        ),
    ):
        if count:
            reasons.append(f"{what}: {count}")
    not_done = tally.valid - tally.done - tally.lost
    if not_done > allowed_failures:
        reasons.append(f"valid requests not done: {not_done} (allowed {allowed_failures})")
    if not scheduler_alive:
        reasons.append("the scheduler is not running at the end")
    reasons += [f"check failed: {name}" for name, held in (checks or {}).items() if not held]
    return Verdict(ok=not reasons, reasons=tuple(reasons))
