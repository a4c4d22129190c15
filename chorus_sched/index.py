"""The Qdrant adapter: the donor index. The scheduler is its only writer.

One point per finished request (``status: ready``) or per group leader still running (``status: running``):
the prompt embedding as the vector, and a payload that says where the trajectory lives and how useful it has
been. Searches are always restricted to one compatibility key (same model, shape, steps, scheduler) and,
unless allowed, to one tenant.

Several processes, one index:

- with a Qdrant server (``url``), every operation goes to the server;
- Qdrant *local mode* (``path``) lets only one process open a folder at a time. Here the index opens the
  folder per operation, under an exclusive ``flock`` on ``<path>/.chorus-index.lock``, and closes it after,
  so scheduler instances on one machine share one index. ``hold()`` keeps it open across several operations
  (a search and the upsert that depends on it, or a batch), which also makes them atomic with respect to the
  other processes. Opening reads the whole folder, so local mode suits the embedded setup's thousands of
  donors, not production (use a server).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from qdrant_client import QdrantClient
from qdrant_client.http import models as qm

log = logging.getLogger(__name__)

_POINT_NAMESPACE = uuid.UUID("6f1c1d0e-5b1e-4c8e-9a57-2f1f4b1b2c3d")
LOCK_FILE = ".chorus-index.lock"


class DonorStatus(StrEnum):
    """An index entry's status (stored as these strings in the payload)."""

    RUNNING = (
        "running"  # a group leader still being computed (followers may take its steps as they are uploaded)
    )
    READY = "ready"  # a finished request whose trajectory is stored


class IndexUnavailable(RuntimeError):
    """The index cannot be opened now (another process holds it past the wait, or the server is down)."""


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
        timeout_s: int = 10,
    ) -> None:
        self.collection = collection
        self.dim = dim
        self.lock_wait_s = lock_wait_s
        self.server = bool(url)
        self.path = None if url or str(path) == ":memory:" else Path(path)
        self._lock = threading.RLock()
        self._depth = 0
        self._lock_fd: int | None = None
        self._client: QdrantClient | None = None
        if url:
            self._client = QdrantClient(url=url, api_key=api_key, timeout=timeout_s)
        elif self.path is None:
            self._client = QdrantClient(location=":memory:")
        else:
            if not str(path):
                raise ValueError("DonorIndex needs a server url, a local path or ':memory:'")
            self.path.mkdir(parents=True, exist_ok=True)

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
    ) -> DonorIndex:
        """A server at ``url`` if given, else Qdrant local mode at ``path`` (``:memory:`` for none)."""
        index = cls(collection, dim, url=url, path=path, api_key=api_key, lock_wait_s=lock_wait_s)
        index.ensure_collection()
        return index

    @property
    def shared_local(self) -> bool:
        return self.path is not None

    @contextmanager
    def hold(self) -> Iterator[QdrantClient]:
        """The client, kept open (and, in local mode, other processes kept out) until the block ends."""
        with self._lock:
            if self.path is None:
                assert self._client is not None
                yield self._client
                return
            if self._depth == 0:
                fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    self._flock(fd)
                    self._client = QdrantClient(path=str(self.path))
                except BaseException as exc:
                    os.close(fd)  # closing the descriptor releases the lock
                    if isinstance(exc, RuntimeError) and not isinstance(exc, IndexUnavailable):
                        # Qdrant's own storage lock: another client (not a Chorus process) has the folder open.
                        raise IndexUnavailable(
                            f"index at {self.path} is in use by another client: {exc}"
                        ) from exc
                    raise
                self._lock_fd = fd
            self._depth += 1
            try:
                assert self._client is not None
                yield self._client
            finally:
                self._depth -= 1
                if self._depth == 0:
                    try:
                        if self._client is not None:
                            self._client.close()
                    finally:
                        self._client = None
                        if self._lock_fd is not None:
                            os.close(self._lock_fd)
                            self._lock_fd = None

    def _flock(self, fd: int) -> None:
        """Take the folder's lock, waiting at most ``lock_wait_s`` (a wait is logged, never silent)."""
        start = time.monotonic()
        next_report = start + 2.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                now = time.monotonic()
                if now - start >= self.lock_wait_s:
                    raise IndexUnavailable(
                        f"index at {self.path} held by another process for over {self.lock_wait_s:g} s"
                    ) from None
                if now >= next_report:
                    log.warning(
                        "waiting for the index lock",
                        extra={"path": str(self.path), "waited_s": round(now - start, 1)},
                    )
                    next_report = now + 5.0
                time.sleep(0.02)

    def ensure_collection(self) -> None:
        with self.hold() as client:
            if client.collection_exists(self.collection):
                return
            client.create_collection(
                self.collection, vectors_config=qm.VectorParams(size=self.dim, distance=qm.Distance.COSINE)
            )
            # Local mode scans payloads and has no payload indexes; a server needs them to filter fast.
            for name in ("compat_key", "tenant", "status") if self.server else ():
                client.create_payload_index(self.collection, name, qm.PayloadSchemaType.KEYWORD)

    def upsert(self, entry: DonorEntry, vector: Sequence[float]) -> None:
        if len(vector) != self.dim:
            raise ValueError(f"vector has {len(vector)} dimensions, the index {self.dim}")
        with self.hold() as client:
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
            points = client.retrieve(self.collection, ids=[point_id(request_id)], with_payload=True)
        return DonorEntry.model_validate(points[0].payload) if points else None

    def update(self, entry: DonorEntry) -> None:
        """Overwrite an existing entry's payload without touching its vector."""
        with self.hold() as client:
            client.overwrite_payload(
                self.collection,
                payload=entry.model_dump(mode="json"),
                points=[point_id(entry.request_id)],
                wait=True,
            )

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
            with self.hold() as client:
                client.delete(
                    self.collection,
                    points_selector=qm.PointIdsList(points=[point_id(r) for r in request_ids]),
                    wait=True,
                )

    def entries(self, batch: int = 256) -> list[DonorEntry]:
        out: list[DonorEntry] = []
        offset: qm.ExtendedPointId | None = None
        with self.hold() as client:
            while True:
                points, offset = client.scroll(
                    self.collection, limit=batch, offset=offset, with_payload=True, with_vectors=False
                )
                out.extend(DonorEntry.model_validate(p.payload) for p in points)
                if offset is None:
                    return out

    def count(self) -> int:
        with self.hold() as client:
            return client.count(self.collection, exact=True).count

    def close(self) -> None:
        with self._lock:
            if self.path is None and self._client is not None:
                self._client.close()
                self._client = None
