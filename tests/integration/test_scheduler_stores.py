"""The scheduler's stores: the ledger (Redis and the embedded SQLite one) and the donor index shared by processes."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from chorus_sched.index import DonorEntry, DonorIndex, DonorStatus
from chorus_sched.ledger import Ledger, RequestRecord, RequestState
from chorus_sched.ledger_redis import RedisLedger
from chorus_sched.ledger_sqlite import SqliteLedger
from chorus_sched.ledger_stores import ledger_from_url, open_ledger
from producer.settings import UnusableSetting

pytestmark = pytest.mark.integration

FORK = multiprocessing.get_context("fork")


@pytest.fixture(params=["redis", "sqlite"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return f"sqlite:///{tmp_path / 'ledger.sqlite3'}"


@pytest.fixture
def prefix(ledger_url: str) -> Iterator[str]:
    """Keys of one test; removed from Redis afterwards."""
    value = f"test:{uuid.uuid4().hex}:"
    yield value
    if ledger_url.startswith("redis://"):
        client = redis.Redis.from_url(ledger_url)
        keys = list(client.scan_iter(match=f"{value}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def ledger(ledger_url: str, prefix: str) -> Iterator[Ledger]:
    store = ledger_from_url(ledger_url, prefix=prefix, ttl_s=600)
    yield store
    store.close()


def record(rid: str) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        tenant="t",
        prompt="p",
        model="toy",
        compat_key="k",
        num_steps=4,
        reuse="auto",
        role="leader",
    )


def test_claims_are_new_then_duplicate_once_dispatched(ledger: Ledger) -> None:
    first = ledger.begin("r1", owner="A", lease_s=60)
    assert first.outcome == "new" and first.ours
    assert ledger.state("r1") == "accepted"
    assert ledger.begin("r1", owner="A", lease_s=60).outcome == "resumed"  # our own retry
    busy = ledger.begin("r1", owner="B", lease_s=60)
    assert busy.outcome == "busy" and busy.owner == "A" and not busy.ours
    dispatched = record("r1")
    ledger.record_dispatch(dispatched)
    assert ledger.state("r1") == "dispatched"
    assert ledger.record("r1") == dispatched
    dup = ledger.begin("r1", owner="B", lease_s=60)
    assert dup.outcome == "duplicate" and dup.state == "dispatched"
    ledger.set_state("r1", RequestState.DONE)
    assert ledger.begin("r1", owner="C", lease_s=60).state == "done"
    assert ledger.record("r1") == dispatched  # state changes keep the record


def test_an_expired_lease_is_taken_over(ledger: Ledger) -> None:
    assert ledger.begin("r2", owner="crashed", lease_s=0.05).outcome == "new"
    time.sleep(0.1)
    taken = ledger.begin("r2", owner="B", lease_s=60)
    assert taken.outcome == "resumed" and taken.owner == "crashed"
    assert ledger.begin("r2", owner="C", lease_s=60).outcome == "busy"


def test_release_forgets_and_the_simple_claim_still_works(ledger: Ledger) -> None:
    assert ledger.claim("r3") is True
    assert ledger.claim("r3") is False
    ledger.release("r3")
    assert ledger.state("r3") is None and ledger.record("r3") is None
    assert ledger.claim("r3") is True


def test_marks_counters_and_pending_evictions(ledger: Ledger) -> None:
    assert ledger.mark_once("hit:r1") is True
    assert ledger.mark_once("hit:r1") is False
    assert ledger.is_marked("hit:r1") and not ledger.is_marked("hit:r2")
    assert ledger.add_hit("d", 2.0) == (1, 2.0)
    assert ledger.add_hit("d", 3.5) == (2, 5.5)
    ledger.add_pending_evictions(["a", "b"], "budget")
    ledger.add_pending_evictions(["c"], "ttl")
    assert ledger.pending_evictions() == {"a": "budget", "b": "budget", "c": "ttl"}
    ledger.remove_pending_evictions(["a", "c"])
    assert ledger.pending_evictions() == {"b": "budget"}


def _claim_all(url: str, prefix: str, owner: str, ids: list[str], out: multiprocessing.Queue) -> None:
    store = ledger_from_url(url, prefix=prefix, ttl_s=600)
    won = [rid for rid in ids if store.begin(rid, owner=owner, lease_s=60).outcome == "new"]
    for _ in range(25):
        store.add_hit("shared", 1.0)
    out.put((owner, won))
    store.close()


def test_processes_claim_each_id_exactly_once_and_count_every_hit(ledger_url: str, prefix: str) -> None:
    ids = [f"r{i}" for i in range(40)]
    out = FORK.Queue()
    procs = [FORK.Process(target=_claim_all, args=(ledger_url, prefix, f"p{i}", ids, out)) for i in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    won = [rid for _, claimed in results for rid in claimed]
    assert sorted(won) == sorted(ids)  # every id claimed, none twice
    store = ledger_from_url(ledger_url, prefix=prefix, ttl_s=600)
    assert store.add_hit("shared", 0.0) == (76, 75.0)
    store.close()


def _locked_increments(url: str, prefix: str, counter: str, n: int) -> None:
    store = ledger_from_url(url, prefix=prefix, ttl_s=600)
    path = Path(counter)
    for _ in range(n):
        with store.mutex("counter"):
            value = int(path.read_text())
            time.sleep(0.002)  # widen the window a lost update would need
            path.write_text(str(value + 1))
    store.close()


def test_the_mutex_excludes_other_processes(ledger_url: str, prefix: str, tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    procs = [
        FORK.Process(target=_locked_increments, args=(ledger_url, prefix, str(counter), 15)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert counter.read_text() == "30"


def test_a_dead_holders_mutex_expires(ledger: Ledger) -> None:
    assert ledger.try_lock("x", "dead", ttl_s=0.05)
    assert not ledger.try_lock("x", "other", ttl_s=1)
    time.sleep(0.1)
    with ledger.mutex("x", wait_s=5):
        assert not ledger.try_lock("x", "third", ttl_s=1)
    assert ledger.try_lock("x", "third", ttl_s=1)


@pytest.mark.parametrize("ended", ["failed", "dead_lettered"])
def test_a_request_that_ended_without_a_video_can_be_sent_again(ledger: Ledger, ended: str) -> None:
    first = ledger.begin("r-again", owner="a", lease_s=60, origin="requests:0:10")
    assert first.outcome == "new"
    ledger.set_state("r-again", RequestState(ended))
    # The same message read again (a redelivery) is not a new attempt...
    redelivered = ledger.begin("r-again", owner="b", lease_s=60, origin="requests:0:10")
    assert redelivered.outcome == "duplicate" and not redelivered.ours
    # ...but another message with the same id is the sender trying again.
    again = ledger.begin("r-again", owner="b", lease_s=60, origin="requests:1:3")
    assert again.outcome == "retry" and again.ours and again.state == ended
    assert ledger.state("r-again") == "accepted"
    assert ledger.begin("r-again", owner="c", lease_s=60, origin="requests:1:4").outcome == "busy"


def test_a_request_that_was_served_stays_a_duplicate_that_names_the_message_it_was_claimed_from(
    ledger: Ledger,
) -> None:
    ledger.begin("r-served", owner="a", lease_s=60, origin="requests:0:1")
    ledger.record_dispatch(record("r-served"))
    ledger.set_state("r-served", RequestState.DONE)
    again = ledger.begin("r-served", owner="b", lease_s=60, origin="requests:0:2")
    assert (again.outcome, again.origin) == ("duplicate", "requests:0:1")
    assert again.resent_by("requests:0:2")  # a new message with the id: its sender asks again
    redelivered = ledger.begin("r-served", owner="b", lease_s=60, origin="requests:0:1")
    assert redelivered.outcome == "duplicate" and not redelivered.resent_by("requests:0:1")


def test_an_older_ledger_file_gains_the_origin_column(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE requests (request_id TEXT PRIMARY KEY, state TEXT NOT NULL, owner TEXT, lease_until REAL,"
        " record TEXT, expires_at REAL NOT NULL)"
    )
    db.close()
    store = SqliteLedger(path)
    assert store.begin("r", owner="a", lease_s=5, origin="t:0:0").outcome == "new"
    store.close()


def test_dispatched_records_are_those_still_waiting_for_a_result(ledger: Ledger) -> None:
    for rid in ("w-1", "w-2", "w-3"):
        ledger.begin(rid, owner="a", lease_s=60)
        ledger.record_dispatch(record(rid).model_copy(update={"order": "{}", "dispatched_at": 5.0}))
    ledger.set_state("w-2", RequestState.DONE)
    ledger.release("w-3")
    [waiting] = ledger.dispatched_records()
    assert waiting.request_id == "w-1" and waiting.order == "{}" and waiting.dispatched_at == 5.0


def test_values_expire_and_waiting_lists_are_taken_once(ledger: Ledger) -> None:
    ledger.put_value("exact:t:fp:done", "result", ttl_s=0.2)
    assert ledger.get_value("exact:t:fp:done") == "result"
    time.sleep(0.3)
    assert ledger.get_value("exact:t:fp:done") is None
    ledger.put_value("k", "v")
    ledger.delete_value("k")
    assert ledger.get_value("k") is None
    for value in ("a", "b", "c"):
        ledger.add_waiter("exact:t:fp", value)
    assert ledger.take_waiters("exact:t:fp") == ["a", "b", "c"]
    assert ledger.take_waiters("exact:t:fp") == []


def test_a_live_holder_keeps_its_mutex_past_the_lease(ledger: Ledger) -> None:
    with ledger.mutex("held", ttl_s=0.3, owner="sched-a"):
        time.sleep(1.0)  # three leases: the renewer must have extended it
        holder = ledger.lock_holder("held")
        assert holder is not None and holder.startswith("sched-a:")
        assert not ledger.try_lock("held", "other", ttl_s=1)
    assert ledger.lock_holder("held") is None


def _hold_forever(url: str, prefix: str, ready: str) -> None:
    store = ledger_from_url(url, prefix=prefix, ttl_s=600)
    with store.mutex("group:k", ttl_s=1.0, owner="killed-scheduler"):
        Path(ready).write_text("held")
        time.sleep(600)


def test_a_killed_holders_mutex_is_free_within_its_short_lease(
    ledger_url: str, prefix: str, ledger: Ledger, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    proc = FORK.Process(target=_hold_forever, args=(ledger_url, prefix, str(ready)))
    proc.start()
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # past one lease: only renewal keeps it held
    holder = ledger.lock_holder("group:k")
    assert holder is not None and holder.startswith("killed-scheduler:")
    proc.kill()  # SIGKILL: no unlock, no more renewals
    proc.join(timeout=30)
    start = time.monotonic()
    with ledger.mutex("group:k", ttl_s=1.0, wait_s=30, owner="restarted"):
        waited = time.monotonic() - start
    assert waited <= 2.0, waited


def test_open_ledger_picks_sqlite_without_redis_and_redis_with_it(tmp_path: Path, redis_url: str) -> None:
    embedded = open_ledger("", state_dir=tmp_path)
    assert isinstance(embedded, SqliteLedger) and embedded.path == tmp_path / "ledger.sqlite3"
    embedded.close()
    remote = open_ledger(redis_url, state_dir=tmp_path, prefix=f"test:{uuid.uuid4().hex}:")
    assert isinstance(remote, RedisLedger)
    remote.close()
    with pytest.raises(UnusableSetting, match="no ledger store for 'memcached://'"):
        ledger_from_url("memcached://x")


def test_sqlite_ledger_forgets_after_its_ttl(tmp_path: Path) -> None:
    store = SqliteLedger(tmp_path / "l.sqlite3", ttl_s=1)
    store.begin("r", owner="A", lease_s=60)
    store.mark_once("m")
    time.sleep(1.1)
    assert store.state("r") is None and not store.is_marked("m")
    assert store.purge_expired() >= 1
    assert store.begin("r", owner="B", lease_s=60).outcome == "new"
    store.close()


# ---------------------------------------------------------------------------------------------------- index


def _entry(rid: str, *, tenant: str = "t", status: str = "ready") -> DonorEntry:
    return DonorEntry(
        request_id=rid,
        tenant=tenant,
        compat_key="k",
        prompt=f"prompt {rid}",
        trajectory_prefix=f"trajectories/{rid}/",
        status=status,
    )


def _index_worker(path: str, name: str, n: int, keep_open_s: float) -> None:
    index = DonorIndex.connect(path=path, collection="donors", dim=4, keep_open_s=keep_open_s)
    for i in range(n):
        index.upsert(_entry(f"{name}-{i}"), [1.0, float(i), 0.0, 1.0])
        # read-modify-write under one hold: atomic with respect to the other process
        with index.hold():
            shared = index.get("shared")
            assert shared is not None
            index.set_fields("shared", {"hits": shared.hits + 1})
        assert index.search([1.0, 0.0, 0.0, 1.0], compat_key="k", tenant="t", limit=3)
    index.close()


@pytest.mark.parametrize("keep_open_s", [0.0, 600.0], ids=["close-after-each", "keep-open"])
def test_two_processes_share_one_local_mode_index(qdrant_path: Path, keep_open_s: float) -> None:
    """With the folder kept open (and no idle release within the test), the processes only get their turns
    because each lets go when the other announces that it waits."""
    index = DonorIndex.connect(path=qdrant_path, collection="donors", dim=4, keep_open_s=keep_open_s)
    index.upsert(_entry("shared"), [0.0, 0.0, 1.0, 0.0])  # kept open across the fork: the children wait too
    procs = [
        FORK.Process(target=_index_worker, args=(str(qdrant_path), name, 12, keep_open_s))
        for name in ("a", "b")
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    assert index.count() == 25
    shared = index.get("shared")
    assert shared is not None and shared.hits == 24  # no lost update
    index.close()


def test_search_filters_by_status_and_set_fields_reports_missing_entries() -> None:
    index = DonorIndex.connect(path=":memory:", collection="donors", dim=3)
    index.upsert(_entry("done"), [1, 0, 0])
    index.upsert(_entry("running", status="running"), [1, 0, 0])
    index.upsert(_entry("other", tenant="u"), [1, 0, 0])
    ready = index.search([1, 0, 0], compat_key="k", tenant="t", status=DonorStatus.READY)
    assert [h.entry.request_id for h in ready] == ["done"]
    running = index.search([1, 0, 0], compat_key="k", tenant="t", status=DonorStatus.RUNNING)
    assert [h.entry.request_id for h in running] == ["running"] and not running[0].entry.ready
    assert {h.entry.request_id for h in index.search([1, 0, 0], compat_key="k", tenant=None)} == {
        "done",
        "running",
        "other",
    }
    updated = index.set_fields("running", {"status": "ready", "bytes": 10})
    assert updated is not None and updated.ready and updated.bytes == 10
    assert index.set_fields("nope", {"hits": 1}) is None
    assert sorted(e.request_id for e in index.entries(batch=2)) == ["done", "other", "running"]
    index.close()
