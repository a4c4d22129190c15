"""The S3 donor source and trajectory uploader against a real S3 server (moto), with a fake clock.

The clock is injected so the waiting logic is checked exactly (how long, how many polls) without sleeping.
"""

from __future__ import annotations

import hashlib
import io
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from producer.local.standins import EmbeddedService
from producer.orders import (
    abandoned_key,
    header_key,
    step_key,
    trajectory_header_key,
    trajectory_prefix,
    trajectory_step_key,
)
from workers.donors import (
    S3DonorSource,
    TrajectoryEvicted,
    TrajectoryUploader,
    UploadReport,
    delete_trajectory,
)
from workers.engine.errors import CorruptTrajectory, DonorMissing, DonorUnavailable
from workers.engine.trajectory import (
    StepRecord,
    Trajectory,
    TrajectoryMeta,
    encode_header,
    encode_step,
    expected_nbytes,
)
from workers.store import ObjectStore, StoreError


class FakeClock:
    """``sleep`` advances ``now``; ``on_sleep`` hooks run at the n-th sleep (1-based)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []
        self.on_sleep: dict[int, Callable[[], None]] = {}

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds
        hook = self.on_sleep.get(len(self.sleeps))
        if hook is not None:
            hook()


def make_trajectory(request_id: str = "donor-1", steps: int = 3) -> Trajectory:
    gen = torch.Generator().manual_seed(7)
    shape = (4, 2, 4, 4)
    meta = TrajectoryMeta(
        request_id=request_id,
        model="tiny-random-wan",
        weights_id="weights",
        num_frames=2,
        height=16,
        width=16,
        latent_shape=shape,
        token_grid=(2, 2, 2),
        num_steps=steps,
        scheduler="FlowMatchEulerDiscreteScheduler",
        scheduler_hash="abc",
        timesteps=tuple(1000.0 - 250.0 * i for i in range(steps)),
        prompt="a red circle",
        negative_prompt=None,
        guidance_scale=1.0,
        seed=0,
        token_ids=(5, 6, 1, 0),
        tokens=("a", "red", "</s>", "<pad>"),
        valid=(True, True, True, False),
        dtype="float32",
    )
    traj = Trajectory(meta, torch.randn(shape, generator=gen))
    for i in range(steps):
        traj.append(
            StepRecord(
                index=i,
                timestep=meta.timesteps[i],
                latent_after=torch.randn(shape, generator=gen),
                model_output=torch.randn(shape, generator=gen),
                attn_maps=torch.rand(3, 8, generator=gen),
            )
        )
    return traj


@pytest.fixture
def store(s3_server: EmbeddedService) -> Iterator[ObjectStore]:
    store = ObjectStore(
        s3_server.address, f"donors-{uuid.uuid4().hex[:8]}", access_key="test", secret_key="test"
    )
    store.ensure_bucket()
    yield store


def upload_header(store: ObjectStore, traj: Trajectory, prefix: str) -> None:
    store.put(header_key(prefix), encode_header(traj))


def upload_step(store: ObjectStore, traj: Trajectory, prefix: str, index: int) -> None:
    store.put(step_key(prefix, index), encode_step(traj.steps[index]))


def assert_same_record(a: StepRecord, b: StepRecord) -> None:
    assert a.index == b.index and a.timestep == b.timestep
    assert torch.equal(a.latent_after, b.latent_after) and torch.equal(a.model_output, b.model_output)
    assert a.attn_maps is not None and b.attn_maps is not None and torch.equal(a.attn_maps, b.attn_maps)


def test_keys_follow_the_shared_layout() -> None:
    prefix = trajectory_prefix("r-1")
    assert header_key(prefix) == trajectory_header_key("r-1")
    assert step_key(prefix, 12) == trajectory_step_key("r-1", 12)


def test_follower_receives_a_step_uploaded_while_it_waits(store: ObjectStore) -> None:
    traj = make_trajectory()
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    upload_step(store, traj, prefix, 0)
    clock = FakeClock()
    # The leader finishes step 1 during the follower's third wait.
    clock.on_sleep[3] = lambda: upload_step(store, traj, prefix, 1)
    source = S3DonorSource(store, prefix, wait_s=5.0, poll_s=0.5, clock=clock, sleep=clock.sleep)

    assert source.metadata() == traj.meta
    assert torch.equal(source.initial_latent(), traj.initial)
    assert_same_record(source.step(0), traj.steps[0])
    assert clock.sleeps == []
    assert_same_record(source.step(1), traj.steps[1])
    assert clock.sleeps == [0.5, 0.5, 0.5]
    assert not source.gave_up
    # A step read once is served from memory.
    polls = source.polls
    assert_same_record(source.step(1), traj.steps[1])
    assert source.polls == polls


def test_follower_gives_up_after_wait_s_and_then_stops_waiting(store: ObjectStore) -> None:
    traj = make_trajectory()
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    clock = FakeClock()
    source = S3DonorSource(store, prefix, wait_s=2.0, poll_s=0.75, clock=clock, sleep=clock.sleep)
    source.metadata()
    start = clock.now

    with pytest.raises(DonorUnavailable, match="not uploaded within 2 s"):
        source.step(0)
    # Waited exactly wait_s: 0.75 + 0.75 + 0.5 (the last sleep stops at the deadline), one poll after each.
    assert clock.sleeps == [0.75, 0.75, 0.5]
    assert clock.now - start == pytest.approx(2.0)
    assert source.gave_up
    # The leader is taken to be gone: a later step is looked up once, with no wait.
    upload_step(store, traj, prefix, 2)
    with pytest.raises(DonorUnavailable, match="not in the store"):
        source.step(1)
    assert_same_record(source.step(2), traj.steps[2])
    assert len(clock.sleeps) == 3


def test_missing_header_of_a_finished_donor_fails_at_once(store: ObjectStore) -> None:
    clock = FakeClock()
    source = S3DonorSource(store, trajectory_prefix("gone"), clock=clock, sleep=clock.sleep)
    with pytest.raises(DonorUnavailable, match="header is not in the store"):
        source.prefetch(range(2))
    assert clock.sleeps == []


def test_prefetch_reads_and_verifies_header_and_needed_steps(store: ObjectStore) -> None:
    traj = make_trajectory()
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    for i in range(2):
        upload_step(store, traj, prefix, i)
    source = S3DonorSource(store, prefix)
    source.prefetch(range(2))
    assert source.bytes_read == sum(o.size for o in store.list(prefix))
    assert_same_record(source.step(1), traj.steps[1])


def test_once_one_follower_gave_up_on_a_killed_leader_the_others_do_not_wait(store: ObjectStore) -> None:
    traj = make_trajectory("killed-leader")
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    first_clock, second_clock = FakeClock(), FakeClock()
    first = S3DonorSource(store, prefix, wait_s=2.0, poll_s=0.5, clock=first_clock, sleep=first_clock.sleep)
    with pytest.raises(DonorUnavailable, match="not uploaded within 2 s"):
        first.step(0)
    assert first_clock.sleeps == [0.5, 0.5, 0.5, 0.5]
    assert store.exists(abandoned_key(prefix))

    second = S3DonorSource(
        store, prefix, wait_s=2.0, poll_s=0.5, clock=second_clock, sleep=second_clock.sleep
    )
    with pytest.raises(DonorUnavailable, match="another follower found its leader gone"):
        second.step(0)
    assert second_clock.sleeps == [] and second.gave_up
    # What the leader did upload is still served: the marker only stops the waiting.
    upload_step(store, traj, prefix, 1)
    assert_same_record(second.step(1), traj.steps[1])


def test_a_tampered_step_is_corrupt(store: ObjectStore) -> None:
    traj = make_trajectory()
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    blob = bytearray(encode_step(traj.steps[0]))
    blob[-1] ^= 0xFF  # flip bits in the last tensor's data; the blob's own sha256 no longer matches
    store.put(step_key(prefix, 0), bytes(blob))
    with pytest.raises(CorruptTrajectory, match="sha256"):
        S3DonorSource(store, prefix).step(0)


def test_an_object_that_differs_from_its_stored_checksum_is_corrupt_not_unavailable(
    store: ObjectStore,
) -> None:
    # Bytes flipped with the stored checksum kept: a permanent fault, so the donor must be evicted (a
    # DonorUnavailable would be taken as transient and the donor planned again for every similar request).
    traj = make_trajectory()
    prefix = trajectory_prefix(traj.meta.request_id)
    data = encode_header(traj)
    store.client.put_object(
        store.bucket,
        header_key(prefix),
        io.BytesIO(data),
        length=len(data),
        metadata={"sha256": hashlib.sha256(b"something else").hexdigest()},
    )
    with pytest.raises(CorruptTrajectory, match="does not match its stored sha256"):
        S3DonorSource(store, prefix).metadata()


def test_a_step_stored_under_another_index_is_corrupt(store: ObjectStore) -> None:
    traj = make_trajectory()
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    store.put(step_key(prefix, 0), encode_step(traj.steps[1]))
    with pytest.raises(CorruptTrajectory, match="holds step 1"):
        S3DonorSource(store, prefix).step(0)


def test_streaming_upload_writes_header_then_steps_and_finish_adds_nothing(store: ObjectStore) -> None:
    traj = make_trajectory("leader-1", steps=3)
    prefix = trajectory_prefix("leader-1")
    uploader = TrajectoryUploader(store, prefix)
    uploader.start()
    uploader.on_start(Trajectory(traj.meta, traj.initial))
    for record in traj.steps:
        uploader.on_step(record)
    report = uploader.finish(traj)

    assert report.streamed == 4 and report.objects == 4
    stored = {o.key: o.size for o in store.list(prefix)}
    assert set(stored) == {header_key(prefix)} | {step_key(prefix, i) for i in range(3)}
    assert report.bytes == sum(stored.values())
    back = Trajectory.from_parts(
        store.get(header_key(prefix)), [store.get(step_key(prefix, i)) for i in range(3)]
    )
    assert back.meta == traj.meta and torch.equal(back.initial, traj.initial)
    for a, b in zip(back.steps, traj.steps, strict=True):
        assert_same_record(a, b)


def test_finish_uploads_a_whole_trajectory_and_float16_halves_it(store: ObjectStore) -> None:
    traj = make_trajectory("solo-1", steps=2)
    full = TrajectoryUploader(store, trajectory_prefix("solo-1")).finish(traj)
    half = TrajectoryUploader(store, trajectory_prefix("solo-1-fp16"), storage_dtype="float16").finish(traj)
    assert full.objects == half.objects == 3 and full.streamed == 0
    payload = traj.nbytes("float32")
    assert payload < full.bytes and half.bytes < full.bytes
    # Tensor bytes halve; the safetensors headers differ by a few bytes of offsets and padding.
    assert abs((full.bytes - half.bytes) - (payload - traj.nbytes("float16"))) <= 64 * full.objects
    record = S3DonorSource(store, trajectory_prefix("solo-1-fp16")).step(1)
    assert record.latent_after.dtype == torch.float32
    assert torch.allclose(record.latent_after, traj.steps[1].latent_after, atol=1e-2)


def test_a_small_trajectory_is_packed_into_one_object_and_read_back_whole(store: ObjectStore) -> None:
    traj = make_trajectory("packed", steps=3)
    prefix = trajectory_prefix("packed")
    uploader = TrajectoryUploader(store, prefix, pack_max_bytes=1 << 20)
    uploader.start()
    uploader.on_start(Trajectory(traj.meta, traj.initial))
    for record in traj.steps:
        uploader.on_step(record)  # not uploaded one by one
    uploader.on_done(traj)
    report = uploader.finish(traj)

    assert (report.objects, report.streamed) == (1, 1)  # uploaded in the background, after the engine
    assert [o.key for o in store.list(prefix)] == [header_key(prefix)]
    source = S3DonorSource(store, prefix)
    source.prefetch(range(3))
    assert source.metadata() == traj.meta and torch.equal(source.initial_latent(), traj.initial)
    assert source.polls == 1  # one request for the header and every step
    for i in range(3):
        assert_same_record(source.step(i), traj.steps[i])


def test_a_trajectory_over_the_pack_limit_is_stored_step_by_step(store: ObjectStore) -> None:
    traj = make_trajectory("big", steps=2)
    limit = expected_nbytes(traj.meta, "float32")
    assert limit == traj.nbytes("float32")  # the estimate counts the tensors' bytes exactly
    prefix = trajectory_prefix("over-limit")
    TrajectoryUploader(store, prefix, pack_max_bytes=limit - 1).finish(traj)
    streamed = {header_key(prefix)} | {step_key(prefix, i) for i in range(2)}
    assert {o.key for o in store.list(prefix)} == streamed
    prefix = trajectory_prefix("at-limit")
    TrajectoryUploader(store, prefix, pack_max_bytes=limit).finish(traj)
    assert [o.key for o in store.list(prefix)] == [header_key(prefix)]


def test_a_packed_trajectory_without_a_step_in_range_is_corrupt(store: ObjectStore) -> None:
    traj = make_trajectory("short", steps=3)
    prefix = trajectory_prefix("short")
    store.put(header_key(prefix), Trajectory(traj.meta, traj.initial, traj.steps[:2]).to_bytes())
    source = S3DonorSource(store, prefix)
    assert_same_record(source.step(1), traj.steps[1])
    with pytest.raises(CorruptTrajectory, match="holds no step 2"):
        source.step(2)


@pytest.mark.parametrize("pack_max_bytes", [0, 1 << 20], ids=["streamed", "packed"])
def test_the_planned_report_is_exact_before_the_uploads_end_and_finishing_later_stores_it(
    store: ObjectStore, pack_max_bytes: int
) -> None:
    traj = make_trajectory(f"early-{pack_max_bytes}", steps=3)
    prefix = trajectory_prefix(traj.meta.request_id)
    uploader = TrajectoryUploader(store, prefix, pack_max_bytes=pack_max_bytes)
    uploader.start()
    uploader.on_start(Trajectory(traj.meta, traj.initial))
    for record in traj.steps:
        uploader.on_step(record)
    uploader.on_done(traj)
    planned = uploader.planned_report(traj)
    outcomes: list[object] = []
    uploader.finish_in_background(traj, outcomes.append).join(10)

    (done,) = outcomes
    assert isinstance(done, UploadReport)
    assert (done.prefix, done.objects, done.bytes) == (planned.prefix, planned.objects, planned.bytes)
    stored = {o.key: o.size for o in store.list(prefix)}
    assert planned.objects == len(stored) == (1 if pack_max_bytes else 4)
    assert planned.bytes == sum(stored.values())


def test_finishing_later_hands_a_failed_upload_to_its_callback(store: ObjectStore) -> None:
    traj = make_trajectory("early-fails", steps=2)
    broken = ObjectStore(
        store.endpoint, "no-such-bucket-here", access_key="test", secret_key="test", write_retry_s=0
    )
    uploader = TrajectoryUploader(broken, trajectory_prefix("early-fails"))
    outcomes: list[object] = []
    uploader.finish_in_background(traj, outcomes.append).join(30)
    assert len(outcomes) == 1 and isinstance(outcomes[0], Exception)


def test_an_eviction_during_the_late_upload_leaves_nothing_behind(store: ObjectStore) -> None:
    # Another worker process evicts the donor once its header and first step are stored (it cannot wait for an
    # upload it does not see); the tail stored after that is removed by the upload itself.
    traj = make_trajectory("evicted-tail", steps=3)
    prefix = trajectory_prefix(traj.meta.request_id)
    uploader = TrajectoryUploader(store, prefix)
    uploader.start()
    uploader.on_start(Trajectory(traj.meta, traj.initial))
    uploader.on_step(traj.steps[0])
    uploader.stop()
    assert delete_trajectory(store, prefix) == 2
    outcomes: list[object] = []
    uploader.finish_in_background(traj, outcomes.append).join(10)

    (done,) = outcomes
    assert isinstance(done, TrajectoryEvicted) and "2 objects removed" in str(done)
    assert list(store.list(prefix)) == []


def _puts_of(store: ObjectStore, monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.0) -> list[str]:
    """The keys ``store`` is asked to put, in order; each put held back ``delay_s`` (a slow store)."""
    keys: list[str] = []
    real_put = store.put

    def put(key: str, data: bytes, *args: object, **kwargs: object) -> object:
        keys.append(key)
        time.sleep(delay_s)
        return real_put(key, data, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "put", put)
    return keys


def test_storing_the_header_waits_for_the_background_upload_instead_of_putting_it_twice(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    traj = make_trajectory("header-waited", steps=2)
    prefix = trajectory_prefix(traj.meta.request_id)
    puts = _puts_of(store, monkeypatch, delay_s=0.3)
    uploader = TrajectoryUploader(store, prefix)
    uploader.start()
    uploader.on_start(Trajectory(traj.meta, traj.initial))
    uploader.store_header(traj)
    assert store.exists(header_key(prefix))  # stored by the background thread, waited for here
    uploader.stop()
    assert puts.count(header_key(prefix)) == 1


def test_an_abandoned_upload_drops_its_backlog_and_waits_only_for_the_put_under_way(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    traj = make_trajectory("abandoned", steps=6)
    prefix = trajectory_prefix(traj.meta.request_id)
    puts = _puts_of(store, monkeypatch, delay_s=0.3)  # a slow store: the backlog would take ~2 s
    uploader = TrajectoryUploader(store, prefix)
    uploader.start()
    uploader.on_start(Trajectory(traj.meta, traj.initial))
    for record in traj.steps:
        uploader.on_step(record)
    deadline = time.monotonic() + 10
    while not puts and time.monotonic() < deadline:  # the header's put is under way
        time.sleep(0.01)
    started = time.monotonic()
    uploader.abandon()
    assert time.monotonic() - started < 0.9  # one put's 0.3 s, not the backlog's 2.1 s
    assert len(puts) <= 2 and uploader.may_have_stored


@pytest.mark.parametrize("pack_max_bytes", [0, 1 << 20], ids=["streamed", "packed"])
def test_storing_the_header_puts_it_itself_when_no_upload_thread_will(
    store: ObjectStore, pack_max_bytes: int
) -> None:
    # No background thread (and, packed, nothing queued before the engine is done): the header -- a packed
    # trajectory's one object -- is put from the caller, and is readable as such.
    traj = make_trajectory(f"header-put-{pack_max_bytes}", steps=2)
    prefix = trajectory_prefix(traj.meta.request_id)
    uploader = TrajectoryUploader(store, prefix, pack_max_bytes=pack_max_bytes)
    uploader.store_header(traj)
    assert [o.key for o in store.list(prefix)] == [header_key(prefix)]
    source = S3DonorSource(store, prefix)
    assert source.metadata().request_id == traj.meta.request_id


def test_storing_the_header_after_the_background_upload_failed_raises_the_store_error(
    store: ObjectStore,
) -> None:
    traj = make_trajectory("header-refused", steps=2)
    broken = ObjectStore(
        store.endpoint, "no-such-bucket-here", access_key="test", secret_key="test", write_retry_s=0
    )
    uploader = TrajectoryUploader(broken, trajectory_prefix("header-refused"))
    uploader.start()
    uploader.on_start(Trajectory(traj.meta, traj.initial))
    with pytest.raises(StoreError):
        uploader.store_header(traj)
    uploader.stop()


def test_deleting_a_trajectory_removes_its_header_before_listing_the_rest(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    traj = make_trajectory("header-first", steps=2)
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    upload_step(store, traj, prefix, 0)
    upload_step(store, traj, prefix, 1)
    header_at_listing: list[bool] = []
    real_list = store.list

    def listing(prefix: str = "") -> Iterator[object]:
        header_at_listing.append(store.exists(header_key(prefix)))
        return real_list(prefix)

    monkeypatch.setattr(store, "list", listing)
    assert delete_trajectory(store, prefix) == 3
    assert header_at_listing == [False]
    assert list(real_list(prefix)) == []
    assert delete_trajectory(store, prefix) == 0  # idempotent


def test_a_finished_donor_still_uploading_is_waited_for_within_its_grace(store: ObjectStore) -> None:
    traj = make_trajectory("late-tail", steps=3)
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    upload_step(store, traj, prefix, 0)
    clock = FakeClock()
    clock.on_sleep[4] = lambda: upload_step(
        store, traj, prefix, 1
    )  # the tail lands during the 4th poll's wait
    source = S3DonorSource(store, prefix, grace_s=1.0, clock=clock, sleep=clock.sleep)
    source.prefetch(range(2))
    assert_same_record(source.step(1), traj.steps[1])
    assert len(clock.sleeps) == 4 and clock.now - 100.0 < 1.0
    assert not store.exists(abandoned_key(prefix))  # not a follower's wait: nothing marked


def test_a_finished_donor_uploading_slower_than_its_grace_is_unavailable_not_gone(store: ObjectStore) -> None:
    traj = make_trajectory("slow-tail", steps=3)
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    clock = FakeClock()
    clock.on_sleep[2] = lambda: upload_step(store, traj, prefix, 0)  # step 0 lands; step 1 not in time
    source = S3DonorSource(store, prefix, grace_s=0.5, clock=clock, sleep=clock.sleep)
    with pytest.raises(DonorUnavailable, match=r"step 1 is still uploading after 0\.5 s") as raised:
        source.prefetch(range(2))
    assert not isinstance(raised.value, DonorMissing)  # DonorMissing would evict a sound donor
    assert clock.now - 100.0 == pytest.approx(0.5)


def test_a_finished_donor_that_is_gone_costs_at_most_its_grace_in_all(store: ObjectStore) -> None:
    traj = make_trajectory("gone-tail", steps=3)
    prefix = trajectory_prefix(traj.meta.request_id)
    upload_header(store, traj, prefix)
    clock = FakeClock()
    source = S3DonorSource(store, prefix, grace_s=0.05, clock=clock, sleep=clock.sleep)
    with pytest.raises(DonorMissing, match="step 0 is not in the store"):
        source.step(0)
    assert clock.now - 100.0 == pytest.approx(0.05)
    with pytest.raises(DonorMissing, match="step 1 is not in the store"):
        source.step(1)  # the grace is spent: no second wait
    assert clock.now - 100.0 == pytest.approx(0.05)
    assert not store.exists(abandoned_key(prefix))
