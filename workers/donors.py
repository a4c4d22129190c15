"""Donor trajectories in S3: reading them (a ``DonorSource``) and writing them (``TrajectoryUploader``).

Layout (``producer.orders``), two forms, each object sealed with its own sha256 by ``workers.engine.trajectory``:

- packed (a trajectory up to ``pack_max_bytes``): ``<prefix>header.json`` holds the whole trajectory, written
  once the engine is done. An object costs a request however small (~2.5 ms on the stand-in S3 server from 1 kB
  to 400 kB), so a 4-step toy trajectory is written and read in one request instead of five; a group leader's
  followers then take its steps all at once when it ends, not step by step (for a trajectory this small, a
  few tens of milliseconds later);
- streamed (larger ones): ``<prefix>header.json`` holds the metadata and initial latent, then one
  ``<prefix>step-NNNN.safetensors`` per step, uploaded as the engine goes, so that followers start early and
  the uploads overlap the denoising.

A reader tells the two apart by the header object's format (``decode_head``).

Reading, two ways:

- a finished donor (SOLO/LEADER orders): ``prefetch`` (called by the engine's ``prefetch_donor``) downloads the
  header and every step the plan needs before the engine starts, so a missing, corrupt or unreadable donor is found
  out up front and the request runs in full. A worker publishes its result before the last of its trajectory is
  stored, so an object a finished donor's reader does not find yet is looked for again for up to ``grace_s`` (all
  objects together) before the donor is called gone — unless one of them arrived while it waited: an upload
  that is alive but slower than the grace makes the request run in full and leaves the donor in place;
- a running leader (FOLLOWER orders): each accessor polls S3 for its object every ``poll_s`` until ``wait_s`` has
  passed since it began waiting, then raises ``DonorWaitExpired`` for that object (the engine computes that step in
  full). Once one wait has run out the leader is taken to be gone: later objects are looked up once, not waited
  for, so a follower never waits more than ``wait_s`` in all. The follower that gives up leaves an
  ``abandoned`` marker under the prefix, and every other follower of that leader checks it while it waits, so
  only the first of them pays the wait for a leader that was killed.

Writing, from a background thread so the denoising loop never waits for S3: streamed, the header first, then
each step as the engine reports it; packed, the whole trajectory once the engine is done (``on_done``), while
the worker encodes the video. ``finish`` waits for that and uploads whatever is still missing;
``planned_report`` says what it will have stored (each object not stored yet is encoded then, so the sizes are
exact) and ``finish_in_background`` runs ``finish`` after the result has left, then checks that the trajectory was
not evicted meanwhile (``delete_trajectory`` says how the two meet).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from producer.orders import abandoned_key, header_key, step_key
from workers.engine.errors import CorruptTrajectory, DonorMissing, DonorUnavailable, DonorWaitExpired
from workers.engine.trajectory import (
    StepRecord,
    StorageDType,
    Trajectory,
    TrajectoryMeta,
    decode_head,
    decode_step,
    encode_header,
    encode_step,
    expected_nbytes,
)
from workers.store import ObjectCorrupt, ObjectMissing, ObjectStore, StoreError

log = logging.getLogger(__name__)

# How often a finished donor's reader looks again for an object still being uploaded (``S3DonorSource.grace_s``).
GRACE_POLL_S = 0.01


class S3DonorSource:
    """A ``DonorSource`` reading one trajectory from S3 (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        *,
        wait_s: float = 0.0,
        poll_s: float = 0.2,
        grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        self.store = store
        self.prefix = prefix
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        # one grace for the whole source, from its first missing object
        self._grace_until: float | None = None
        self._grace_polls = 0
        self._grace_progress = False  # an object arrived while the grace ran: the upload is alive
        self._clock = clock
        self._sleep = sleep
        self._meta: TrajectoryMeta | None = None
        self._initial: torch.Tensor | None = None
        self._steps: dict[int, StepRecord] = {}
        self._packed = False  # the header object held the whole trajectory: no step objects to read
        self._gave_up = False
        # Seconds spent inside this source (downloads, decoding and waiting), and bytes downloaded.
        self.busy_s = 0.0
        self.bytes_read = 0
        self.polls = 0

    # --- DonorSource ------------------------------------------------------------------------------------
    def metadata(self) -> TrajectoryMeta:
        self._load_header()
        assert self._meta is not None
        return self._meta

    def initial_latent(self) -> torch.Tensor:
        self._load_header()
        assert self._initial is not None
        return self._initial

    def step(self, index: int) -> StepRecord:
        meta = self.metadata()  # a packed trajectory's header object brings every step with it
        cached = self._steps.get(index)
        if cached is not None:
            return cached
        if not 0 <= index < meta.num_steps:
            raise IndexError(f"step {index} out of range 0..{meta.num_steps - 1}")
        if self._packed:
            raise CorruptTrajectory(f"{self.store.uri(header_key(self.prefix))} holds no step {index}")
        start = self._clock()
        try:
            data = self._fetch(step_key(self.prefix, index), f"step {index}")
            record = decode_step(data)
        finally:
            self.busy_s += self._clock() - start
        if record.index != index:
            raise CorruptTrajectory(
                f"{self.store.uri(step_key(self.prefix, index))} holds step {record.index}"
            )
        self._steps[index] = record
        return record

    # --- eager use -----------------------------------------------------------------------------------------
    def prefetch(self, indices: Iterable[int]) -> None:
        """Download and verify the header and the given steps now (raises what the accessors raise)."""
        self._load_header()
        for index in indices:
            self.step(index)

    @property
    def gave_up(self) -> bool:
        """Whether a wait for the leader ran out (later objects are no longer waited for)."""
        return self._gave_up

    # --- internals -------------------------------------------------------------------------------------------
    def _load_header(self) -> None:
        if self._meta is not None:
            return
        start = self._clock()
        try:
            meta, initial, steps = decode_head(self._fetch(header_key(self.prefix), "header"))
        finally:
            self.busy_s += self._clock() - start
        if steps is not None:
            self._steps = {record.index: record for record in steps}
            self._packed = True
        self._meta, self._initial = meta, initial

    def _fetch(self, key: str, what: str) -> bytes:
        deadline: float | None = None
        while True:
            self.polls += 1
            try:
                data = self.store.get_verified(key)
            except ObjectMissing:
                pass
            except ObjectCorrupt as exc:
                # Permanent, unlike a failed read: the donor must be evicted, not planned again.
                raise CorruptTrajectory(f"donor {what} corrupt: {exc}") from exc
            except StoreError as exc:
                raise DonorUnavailable(f"donor {what} unreadable: {exc}") from exc
            else:
                self.bytes_read += len(data)
                self._grace_progress = self._grace_until is not None
                return data
            if self.wait_s <= 0:
                if self._in_grace():
                    continue
                if self._grace_progress:  # slower than the grace, not gone: fall back, keep the donor
                    raise DonorUnavailable(
                        f"donor {what} is still uploading after {self.grace_s:g} s ({self.store.uri(key)})"
                    )
                raise DonorMissing(f"donor {what} is not in the store ({self.store.uri(key)})")
            if self._gave_up:
                raise DonorUnavailable(f"donor {what} is not in the store ({self.store.uri(key)})")
            if self._abandoned():
                self._gave_up = True
                raise DonorWaitExpired(f"donor {what}: another follower found its leader gone; not waiting")
            now = self._clock()
            if deadline is None:
                deadline = now + self.wait_s
            if now >= deadline:
                self._gave_up = True
                self._mark_abandoned()
                raise DonorWaitExpired(
                    f"donor {what} was not uploaded within {self.wait_s:g} s ({self.store.uri(key)})"
                )
            self._sleep(min(self.poll_s, deadline - now))

    def _in_grace(self) -> bool:
        """A finished donor's result can arrive before the last of its upload: poll a short while (all objects
        together at most ``grace_s``) before calling a missing object gone."""
        if self.grace_s <= 0:
            return False
        now = self._clock()
        if self._grace_until is None:
            self._grace_until = now + self.grace_s
        if now >= self._grace_until:
            return False
        # 10 ms at first (a tail is usually that close), doubling to 0.2 s (a gone donor costs few requests)
        poll = min(GRACE_POLL_S * 2 ** min(self._grace_polls, 5), 0.2, self._grace_until - now)
        self._grace_polls += 1
        self._sleep(poll)
        return True

    def _abandoned(self) -> bool:
        try:
            return self.store.exists(abandoned_key(self.prefix))
        except StoreError:
            return False  # the store's trouble; the wait decides

    def _mark_abandoned(self) -> None:
        try:
            self.store.put(abandoned_key(self.prefix), b"", content_type="text/plain", retry=False)
        except StoreError as exc:
            log.warning(
                "could not mark the leader abandoned", extra={"prefix": self.prefix, "error": str(exc)}
            )


def clear_abandoned(store: ObjectStore, prefix: str) -> None:
    """A leader starting is alive: a follower's mark that it was gone (left by an earlier run under this job id,
    or by a follower that waited while this order was queued) would make its followers give up at once."""
    try:
        store.delete(abandoned_key(prefix if prefix.endswith("/") else prefix + "/"))
    except StoreError as exc:
        log.warning(
            "could not clear the leader's abandoned mark", extra={"prefix": prefix, "error": str(exc)}
        )


def delete_trajectory(store: ObjectStore, prefix: str) -> int:
    """Delete a stored trajectory; how many objects went. The header goes first, before the rest is listed: an
    upload still running elsewhere looks for the header once it is done (``TrajectoryUploader``'s late finish)
    and deletes what it stored after the listing, so once the header was stored, whichever order the two take,
    nothing is left behind. The result leaves only once the header is stored (``store_header``); an eviction
    ordered before the result, while the request ran, is followed by another order once the result arrives
    (the scheduler's ``CacheMaintenance.discard``), which finds the header."""
    if not prefix.endswith("/"):
        prefix += "/"
    return store.delete_prefix(prefix, first=header_key(prefix))


class TrajectoryEvicted(Exception):
    """A late upload found its trajectory evicted when it ended, and removed what it had stored since."""


@dataclass
class UploadReport:
    prefix: str
    objects: int
    bytes: int
    streamed: int  # objects uploaded in the background (while the engine ran, or the video was encoded)


# An object of a trajectory: its key, and how to encode it.
_Object = tuple[str, Callable[[], bytes]]


class TrajectoryUploader:
    """Writes one request's trajectory under ``prefix`` from a background thread (see the module docstring):
    packed into one object once the engine is done when it holds at most ``pack_max_bytes`` (0: never), else
    streamed step by step."""

    _STOP = object()

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        *,
        storage_dtype: StorageDType = "float32",
        pack_max_bytes: int = 0,
    ) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        self.store = store
        self.prefix = prefix
        self.storage_dtype: StorageDType = storage_dtype
        self.pack_max_bytes = pack_max_bytes
        self._packed: bool | None = None  # decided once the trajectory's shape is known
        self._sizes: dict[str, int] = {}  # stored objects' sizes
        self._sent = False  # a write went out (a put whose reply was lost may still have stored its object)
        self._blobs: dict[str, bytes] = {}  # objects encoded, not stored yet
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self._header_queued = False  # the background thread has the header (or the packed object) to store
        self._header_stored = threading.Event()
        self._discarding = False  # the trajectory is being discarded: what is queued is not stored
        self.streamed = 0

    @property
    def may_have_stored(self) -> bool:
        """Whether any write went out: the store may hold part of the trajectory even where no reply said so."""
        return self._sent

    def _packs(self, meta: TrajectoryMeta) -> bool:
        if self._packed is None:
            self._packed = expected_nbytes(meta, self.storage_dtype) <= self.pack_max_bytes
        return self._packed

    # --- background uploads -------------------------------------------------------------------------------
    def start(self) -> None:
        """Begin uploading in the background: ``on_start``/``on_step``/``on_done`` enqueue, a thread uploads."""
        self._thread = threading.Thread(target=self._drain, name=f"upload-{self.prefix}", daemon=True)
        self._thread.start()

    def on_start(self, trajectory: Trajectory) -> None:
        if self._thread is not None and not self._packs(trajectory.meta):
            self._queue.put(self._header_object(trajectory.meta, trajectory.initial))
            self._header_queued = True

    def on_step(self, record: StepRecord) -> None:
        if self._thread is not None and not self._packed:
            self._queue.put(self._step_object(record))

    def on_done(self, trajectory: Trajectory) -> None:
        """The engine finished: a packed trajectory is uploaded now, while the caller goes on."""
        if self._thread is not None and self._packs(trajectory.meta):
            self._queue.put(self._whole_object(trajectory))
            self._header_queued = True

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            if self._error is not None or self._discarding:
                continue  # after a failure nothing more is uploaded here; ``finish`` retries what is missing
            try:
                assert isinstance(item, tuple)
                self._put(*item)
                with self._lock:
                    self.streamed += 1
            except Exception as exc:
                self._error = exc
                log.warning("background upload failed", extra={"prefix": self.prefix, "error": str(exc)})

    def stop(self) -> None:
        """Wait for queued uploads to finish."""
        if self._thread is not None:
            self._queue.put(self._STOP)
            self._thread.join()
            self._thread = None

    def abandon(self) -> None:
        """Stop uploading a trajectory that is being discarded: what is queued is dropped, and only the put under
        way is waited for (a failed request after its soft time limit must not upload its backlog first)."""
        self._discarding = True
        self.stop()

    # --- whole trajectory -----------------------------------------------------------------------------------
    def finish(self, trajectory: Trajectory) -> UploadReport:
        """Upload every part of ``trajectory`` not uploaded yet (header first); raises ``StoreError``."""
        self.stop()
        for key, make in self._objects(trajectory):
            if key not in self._sizes:
                self._put(key, make)
        return self._report(self._sizes)

    def store_header(self, trajectory: Trajectory) -> None:
        """Return once the header object (a packed trajectory's one object) is stored; raises ``StoreError``. A
        result that leaves before the rest of the upload waits for this much: an eviction ordered after the
        result then always finds the header it deletes first, and the late finish sees it gone
        (``delete_trajectory``). The background thread normally stored it while the engine ran, and is waited
        for while it has it to store (its puts time out like any other); otherwise the header is put from here."""
        key, make = self._objects(trajectory)[0]
        while not self._header_stored.is_set():
            if self._thread is None or not self._header_queued or self._error is not None:
                self._put(key, make)  # after a failed background put: its retry, or its StoreError
                return
            self._header_stored.wait(0.01)

    def planned_report(self, trajectory: Trajectory) -> UploadReport:
        """What ``finish`` will report once every object is stored: each object not stored yet is encoded now
        (and kept for its upload), so the sizes are exact before the uploads end."""
        sizes: dict[str, int] = {}
        for key, make in self._objects(trajectory):
            with self._lock:  # one section: a key is either stored or encoded here, never both
                size = self._sizes.get(key)
                sizes[key] = size if size is not None else len(self._encoded(key, make))
        return self._report(sizes)

    def finish_in_background(
        self, trajectory: Trajectory, on_done: Callable[[UploadReport | Exception], None]
    ) -> threading.Thread:
        """``finish`` from a thread of its own; ``on_done`` gets its report or what ended it."""

        def run() -> None:
            try:
                outcome: UploadReport | Exception = self._evicted_meanwhile(self.finish(trajectory))
            except Exception as exc:  # reported, never lost with the thread
                outcome = exc
            on_done(outcome)

        thread = threading.Thread(target=run, name=f"finish-{self.prefix}", daemon=True)
        thread.start()
        return thread

    def _evicted_meanwhile(self, report: UploadReport) -> UploadReport | TrajectoryEvicted:
        """After the result left, the entry may have been evicted (by a worker process other than this one, which
        cannot wait for this upload) while the tail was still uploading: the eviction deletes the header before
        listing (``delete_trajectory``), so a header gone now means what was stored after that listing would be
        left behind, indexed by nothing. Delete it."""
        try:
            if self.store.exists(header_key(self.prefix)):
                return report
            deleted = delete_trajectory(self.store, self.prefix)
        except StoreError as exc:  # a failed check is no reason to drop a sound donor
            log.warning(
                "could not check the stored trajectory", extra={"prefix": self.prefix, "error": str(exc)}
            )
            return report
        return TrajectoryEvicted(f"{self.prefix} was evicted while it uploaded; {deleted} objects removed")

    def _report(self, sizes: dict[str, int]) -> UploadReport:
        return UploadReport(
            prefix=self.prefix, objects=len(sizes), bytes=sum(sizes.values()), streamed=self.streamed
        )

    def _objects(self, trajectory: Trajectory) -> list[_Object]:
        """Every object of ``trajectory`` in upload order, each with how to encode it."""
        if self._packs(trajectory.meta):
            return [self._whole_object(trajectory)]
        header = self._header_object(trajectory.meta, trajectory.initial)
        return [header, *(self._step_object(record) for record in trajectory.steps)]

    def _whole_object(self, trajectory: Trajectory) -> _Object:
        return header_key(self.prefix), functools.partial(trajectory.to_bytes, self.storage_dtype)

    def _header_object(self, meta: TrajectoryMeta, initial: torch.Tensor) -> _Object:
        encode = functools.partial(encode_header, meta, initial, storage_dtype=self.storage_dtype)
        return header_key(self.prefix), encode

    def _step_object(self, record: StepRecord) -> _Object:
        return step_key(self.prefix, record.index), functools.partial(encode_step, record, self.storage_dtype)

    def _encoded(self, key: str, make: Callable[[], bytes]) -> bytes:
        """``key``'s encoded object, encoded once whichever thread asks first and kept until it is stored (the
        caller holds ``_lock``)."""
        data = self._blobs.get(key)
        if data is None:
            data = self._blobs[key] = make()
        return data

    def _put(self, key: str, make: Callable[[], bytes]) -> None:
        with self._lock:
            data = self._encoded(key, make)
            self._sent = True
        stored = self.store.put(key, data)
        with self._lock:
            self._sizes[stored.key] = stored.size
            self._blobs.pop(key, None)
        if key == header_key(self.prefix):
            self._header_stored.set()
