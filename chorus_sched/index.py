"""The Qdrant adapter: the donor index. The scheduler is its only writer.

One point per finished request (``status: ready``) or per group leader still running (``status: running``):
the prompt embedding as the vector, and a payload that says where the trajectory lives and how useful it has
been. Searches are always restricted to one compatibility key (same model, shape, steps, scheduler) and,
unless allowed, to one tenant.

Several processes, one index:

- with a Qdrant server (``url``), every operation goes to the server;
- Qdrant *local mode* (``path``) lets only one process open a folder at a time. Here the index opens the
  folder under the lock Chorus processes share it by (``chorus_sched.index_lock``), so scheduler instances
  and tools on one machine share one index. Opening is costly (the client reads every point), so the folder
  stays open between operations until another process asks for it or it has been idle ``keep_open_s``
  (0: close after every operation). ``hold()`` keeps it open across several operations (a search and the
  upsert that depends on it, or a batch), which also makes them atomic with respect to the other processes.
  Local mode suits the embedded setup's thousands of donors, not production (use a server).
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, Field
from qdrant_client import QdrantClient
from qdrant_client.http import models as qm

from chorus_sched.index_lock import LOCK_FILE, FolderLock, IndexUnavailable
from chorus_sched.index_mirror import SearchMirror

__all__ = ["LOCK_FILE", "DonorEntry", "DonorHit", "DonorIndex", "DonorStatus", "IndexUnavailable"]

log = logging.getLogger(__name__)

_POINT_NAMESPACE = uuid.UUID("6f1c1d0e-5b1e-4c8e-9a57-2f1f4b1b2c3d")


class DonorStatus(StrEnum):
    """An index entry's status (stored as these strings in the payload)."""

    RUNNING = (
        "running"  # a group leader still being computed (followers may take its steps as they are uploaded)
    )
    READY = "ready"  # a finished request whose trajectory is stored


class DonorEntry(BaseModel):
    request_id: str
    tenant: str
    compat_key: str
    prompt: str
    trajectory_prefix: str = Field(description="S3 key prefix of the trajectory objects")
    status: DonorStatus = DonorStatus.READY
    trajectory_uri: str | None = None
    video_uri: str | None = None
    model: str = ""
    bytes: int = Field(default=0, ge=0)
    num_steps: int = Field(default=0, ge=0)
    # The seed of the noise the trajectory starts from (None: another request's, not known): what keep_seed matches.
    seed: int | None = None
    created_at: float = Field(default_factory=time.time)
    last_hit_at: float | None = None
    hits: int = Field(default=0, ge=0)
    steps_saved: float = Field(default=0.0, ge=0.0)

    @property
    def ready(self) -> bool:
        return self.status == DonorStatus.READY


class DonorHit(BaseModel):
    entry: DonorEntry
    similarity: float


def point_id(request_id: str) -> str:
    return str(uuid.uuid5(_POINT_NAMESPACE, request_id))


class DonorIndex:
    def __init__(
        self,
        collection: str,
        dim: int,
        *,
        url: str = "",
        path: str | Path = "",
        api_key: str | None = None,
        lock_wait_s: float = 10.0,
        keep_open_s: float = 0.0,
        timeout_s: int = 10,
    ) -> None:
        self.collection = collection
        self.dim = dim
        self.lock_wait_s = lock_wait_s
        self.keep_open_s = keep_open_s
        self.server = bool(url)
        self.path = None if url or str(path) == ":memory:" else Path(path)
        self.opens = 0  # how many times the local-mode folder was opened (each reads the whole folder)
        self._lock = threading.RLock()
        self._depth = 0
        self._client: QdrantClient | None = None
        self._mirror: SearchMirror[DonorEntry] | None = None  # local mode, while the folder is open
        self._folder = FolderLock(self.path, lock_wait_s) if self.path is not None else None
        self._last_used = 0.0
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()
        _INDEXES.add(self)
        if url:
            self._client = QdrantClient(url=url, api_key=api_key, timeout=timeout_s)
        elif self.path is None:
            self._client = QdrantClient(location=":memory:")
        else:
            if not str(path):
                raise ValueError("DonorIndex needs a server url, a local path or ':memory:'")
            self.path.mkdir(parents=True, exist_ok=True)

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's open folder, lock and threads are the parent's."""
        self._lock = threading.RLock()
        self._depth = 0
        self._watcher = None
        if self.path is not None:
            if self._client is not None:
                # Never closed (nor collected, whose __del__ closes): closing unlocks Qdrant's storage lock
                # through the descriptor the parent shares, and closes the parent's database.
                _INHERITED_CLIENTS.append(self._client)
            self._client = None
            self._mirror = None

    @classmethod
    def connect(
        cls,
        *,
        url: str = "",
        path: str | Path = "",
        api_key: str | None = None,
        collection: str,
        dim: int,
        lock_wait_s: float = 10.0,
        keep_open_s: float = 0.0,
    ) -> DonorIndex:
        """A server at ``url`` if given, else Qdrant local mode at ``path`` (``:memory:`` for none)."""
        index = cls(
            collection,
            dim,
            url=url,
            path=path,
            api_key=api_key,
            lock_wait_s=lock_wait_s,
            keep_open_s=keep_open_s,
        )
        index.ensure_collection()
        return index

    @property
    def shared_local(self) -> bool:
        return self.path is not None

    @contextmanager
    def hold(self) -> Iterator[QdrantClient]:
        """The client, kept open (and, in local mode, other processes kept out) until the block ends.

        Write through this class' methods, not through the client: in local mode they also keep the in-memory
        copy that searches read."""
        with self._lock:
            if self.path is None:
                assert self._client is not None
                yield self._client
                return
            if self._depth == 0 and self._client is None:
                self._open_local()
            self._depth += 1
            try:
                assert self._client is not None
                yield self._client
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._after_operation()

    def _open_local(self) -> None:
        assert self._folder is not None
        self._folder.acquire()
        try:
            self._client = QdrantClient(path=str(self.path))
        except BaseException as exc:
            self._folder.release()
            if isinstance(exc, RuntimeError) and not isinstance(exc, IndexUnavailable):
                # Qdrant's own storage lock: another client (not a Chorus process) has the folder open.
                raise IndexUnavailable(f"index at {self.path} is in use by another client: {exc}") from exc
            raise
        _commit_without_fsync(self._client)  # never raises: the setting is a speed-up only
        self.opens += 1
        if self.keep_open_s > 0:  # a copy pays off only for a folder kept open across operations
            try:
                self._mirror = self._load_mirror(self._client)
            except BaseException:
                self.release()
                raise

    @contextmanager
    def _write(self) -> Iterator[QdrantClient]:
        """A write, held. One that fails partway may leave the copy unlike the folder: the copy is dropped, and
        reads go to Qdrant until the folder is opened again."""
        with self.hold() as client:
            try:
                yield client
            except BaseException:
                self._mirror = None
                raise

    def _load_mirror(self, client: QdrantClient, batch: int = 512) -> SearchMirror[DonorEntry]:
        mirror: SearchMirror[DonorEntry] = SearchMirror(self.dim)
        if not client.collection_exists(self.collection):
            return mirror  # ensure_collection creates it empty
        offset: qm.ExtendedPointId | None = None
        while True:
            points, offset = client.scroll(
                self.collection, limit=batch, offset=offset, with_payload=True, with_vectors=True
            )
            for p in points:
                entry = DonorEntry.model_validate(p.payload)
                vector = cast(list[float], p.vector)
                mirror.put(str(p.id), entry, _fields(entry), vector, entry.created_at)
            if offset is None:
                return mirror

    def _after_operation(self) -> None:
        """Keep the folder open for the next operation unless another process waits for it."""
        assert self._folder is not None
        if self.keep_open_s <= 0 or self._closed.is_set() or self._folder.others_waiting():
            self.release()
            return
        self._last_used = time.monotonic()
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="index-lease", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """While the folder is kept open and idle: let go after ``keep_open_s``, or as soon as someone waits."""
        assert self._folder is not None
        while not self._closed.wait(self._folder.poll_s * 2.5):
            if not self._lock.acquire(blocking=False):
                continue  # an operation is running; it decides at its end
            try:
                idle = time.monotonic() - self._last_used >= self.keep_open_s
                if self._client is not None and self._depth == 0 and (idle or self._folder.others_waiting()):
                    self.release()
                if self._client is None:
                    self._watcher = None  # under the lock: the next kept-open operation starts a new one
                    return
            finally:
                self._lock.release()
        self._watcher = None

    def _release_for_fork(self) -> None:
        """``release`` before a fork, once an operation under way in another thread has ended (a fork from
        inside ``hold`` keeps the folder: the child then must not open this index's folder itself)."""
        if self.path is None or self._client is None:
            return
        if not self._lock.acquire(timeout=self.lock_wait_s):
            return
        try:
            self.release()
        finally:
            self._lock.release()

    def release(self) -> None:
        """Close the local-mode folder now (other processes may open it); the next operation opens it again."""
        with self._lock:
            if self.path is None or self._depth > 0:
                return
            try:
                if self._client is not None:
                    self._client.close()
            finally:
                self._client = None
                self._mirror = None
                if self._folder is not None:
                    self._folder.release()

    def ensure_collection(self) -> None:
        with self.hold() as client:
            if client.collection_exists(self.collection):
                return
            client.create_collection(
                self.collection, vectors_config=qm.VectorParams(size=self.dim, distance=qm.Distance.COSINE)
            )
            _commit_without_fsync(client)
            # Local mode scans payloads and has no payload indexes; a server needs them to filter fast.
            for name in ("compat_key", "tenant", "status") if self.server else ():
                client.create_payload_index(self.collection, name, qm.PayloadSchemaType.KEYWORD)

    def upsert(self, entry: DonorEntry, vector: Sequence[float]) -> None:
        if len(vector) != self.dim:
            raise ValueError(f"vector has {len(vector)} dimensions, the index {self.dim}")
        with self._write() as client:
            client.upsert(
                self.collection,
                points=[
                    qm.PointStruct(
                        id=point_id(entry.request_id),
                        vector=list(vector),
                        payload=entry.model_dump(mode="json"),
                    )
                ],
                wait=True,
            )
            if self._mirror is not None:
                pid = point_id(entry.request_id)
                self._mirror.put(pid, entry.model_copy(), _fields(entry), vector, entry.created_at)

    def search(
        self,
        vector: Sequence[float],
        *,
        compat_key: str,
        tenant: str | None,
        limit: int = 5,
        status: DonorStatus | None = None,
    ) -> list[DonorHit]:
        """Nearest entries with this compatibility key; ``tenant=None`` searches every tenant, ``status=None``
        both finished donors and running leaders."""
        with self.hold():
            if self._mirror is not None:
                where = (compat_key, tenant, None if status is None else str(status))
                return [
                    DonorHit(entry=entry.model_copy(), similarity=score)
                    for entry, score in self._mirror.search(vector, where, limit)
                ]
        must: list[qm.Condition] = [
            qm.FieldCondition(key="compat_key", match=qm.MatchValue(value=compat_key))
        ]
        if tenant is not None:
            must.append(qm.FieldCondition(key="tenant", match=qm.MatchValue(value=tenant)))
        if status is not None:
            must.append(qm.FieldCondition(key="status", match=qm.MatchValue(value=str(status))))
        with self.hold() as client:
            response = client.query_points(
                self.collection,
                query=list(vector),
                query_filter=qm.Filter(must=must),
                limit=limit,
                with_payload=True,
            )
        return [
            DonorHit(entry=DonorEntry.model_validate(p.payload), similarity=float(p.score))
            for p in response.points
        ]

    def get(self, request_id: str) -> DonorEntry | None:
        with self.hold() as client:
            if self._mirror is not None:
                entry = self._mirror.get(point_id(request_id))
                return None if entry is None else entry.model_copy()
            points = client.retrieve(self.collection, ids=[point_id(request_id)], with_payload=True)
        return DonorEntry.model_validate(points[0].payload) if points else None

    def update(self, entry: DonorEntry) -> None:
        """Overwrite an existing entry's payload without touching its vector."""
        with self._write() as client:
            client.overwrite_payload(
                self.collection,
                payload=entry.model_dump(mode="json"),
                points=[point_id(entry.request_id)],
                wait=True,
            )
            if self._mirror is not None:
                pid = point_id(entry.request_id)
                self._mirror.update(pid, entry.model_copy(), _fields(entry), entry.created_at)

    def set_fields(self, request_id: str, fields: Mapping[str, Any]) -> DonorEntry | None:
        """Change some payload fields of an entry; returns the updated entry, or None if there is no entry."""
        with self.hold():
            entry = self.get(request_id)
            if entry is None:
                return None
            updated = DonorEntry.model_validate({**entry.model_dump(), **fields})
            self.update(updated)
            return updated

    def delete(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            with self._write() as client:
                client.delete(
                    self.collection,
                    points_selector=qm.PointIdsList(points=[point_id(r) for r in request_ids]),
                    wait=True,
                )
                if self._mirror is not None:
                    self._mirror.remove(point_id(r) for r in request_ids)

    def entries(self, batch: int = 256) -> list[DonorEntry]:
        out: list[DonorEntry] = []
        offset: qm.ExtendedPointId | None = None
        with self.hold() as client:
            if self._mirror is not None:
                return [e.model_copy() for e in self._mirror.entries()]
            while True:
                points, offset = client.scroll(
                    self.collection, limit=batch, offset=offset, with_payload=True, with_vectors=False
                )
                out.extend(DonorEntry.model_validate(p.payload) for p in points)
                if offset is None:
                    return out

    def count(self) -> int:
        with self.hold() as client:
            if self._mirror is not None:
                return len(self._mirror)
            return client.count(self.collection, exact=True).count

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self.path is not None:
                self.release()
            elif self._client is not None:
                self._client.close()
                self._client = None


def _commit_without_fsync(client: QdrantClient) -> None:
    """Local mode's collections commit each point to SQLite in its default rollback-journal mode, which waits
    for two or three fsyncs per point (~1.2 ms here, against ~0.1 ms in WAL): the feedback thread wrote a donor
    entry per result and a hit count per reuse under ``hold``, and the intake waited for the index behind them
    (``chorus bench sched``). WAL with ``synchronous=NORMAL`` commits without waiting for the disk; a commit
    that a power cut loses was a donor entry or a hit count of a cache, never a request or its answer (the
    ledger keeps those). NORMAL is set only once the file is in WAL (in the rollback journal it would risk the
    file, not just its last commits). A speed-up only: a file that cannot switch (another reader holds it, say)
    or a qdrant-client that keeps its storage elsewhere keeps its default, said once in the log. A process
    that forks lets go of the folder first (``_release_indexes_before_fork``)."""
    collections = getattr(getattr(client, "_client", None), "collections", None)
    if not isinstance(collections, dict):
        return  # a server
    for collection in collections.values():
        storage = getattr(collection, "storage", None)
        if storage is None:
            continue  # :memory:
        db = getattr(storage, "storage", None)
        if not isinstance(db, sqlite3.Connection):
            _warn_once("qdrant-client keeps its local storage elsewhere; its commits wait for the disk")
            continue
        try:
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()
            if mode is not None and str(mode[0]).lower() == "wal":
                db.execute("PRAGMA synchronous = NORMAL")
            else:
                _warn_once(f"donor index file stays in journal mode {mode}; its commits wait for the disk")
        except sqlite3.Error as exc:
            _warn_once(
                f"donor index file not switched to write-ahead logging ({exc}); commits wait for the disk"
            )


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def _fields(entry: DonorEntry) -> tuple[str, str, str]:
    """What a search filters on, in ``SearchMirror`` order."""
    return (entry.compat_key, entry.tenant, str(entry.status))


_INDEXES: weakref.WeakSet[DonorIndex] = weakref.WeakSet()
_INHERITED_CLIENTS: list[QdrantClient] = []  # a forked child's copies of its parent's open clients


def _forget_indexes_in_child() -> None:
    for index in list(_INDEXES):
        index._forget_after_fork()


def _release_indexes_before_fork() -> None:
    """Close every idle local-mode folder before the process forks. A child inherits an open SQLite connection
    it does not own: in WAL mode its stale shared-memory mapping and lock state made the child's own later
    connections to the file fail ('disk I/O error') or read past a write (a point lost), once someone else had
    written in between. Closing first checkpoints the log; the parent opens the folder again when it next needs
    it (a read of every point, rare: nothing in Chorus forks a process that holds the index)."""
    for index in list(_INDEXES):
        index._release_for_fork()


os.register_at_fork(before=_release_indexes_before_fork, after_in_child=_forget_indexes_in_child)
