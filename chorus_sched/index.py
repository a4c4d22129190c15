"""The Qdrant adapter: the donor index. The scheduler is its only writer.

One point per finished (or in-progress leader) request: the prompt embedding as the vector, and a payload
that says where the trajectory lives and how useful it has been. Searches are always restricted to one
compatibility key (same model, shape, steps, scheduler) and, unless allowed, to one tenant.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from pydantic import BaseModel, Field
from qdrant_client import QdrantClient
from qdrant_client.http import models as qm

log = logging.getLogger(__name__)

_POINT_NAMESPACE = uuid.UUID("6f1c1d0e-5b1e-4c8e-9a57-2f1f4b1b2c3d")


class DonorEntry(BaseModel):
    request_id: str
    tenant: str
    compat_key: str
    prompt: str
    trajectory_prefix: str = Field(description="S3 key prefix of the trajectory objects")
    video_uri: str | None = None
    bytes: int = Field(default=0, ge=0)
    num_steps: int = Field(default=0, ge=0)
    created_at: float = Field(default_factory=time.time)
    last_hit_at: float | None = None
    hits: int = Field(default=0, ge=0)
    steps_saved: float = Field(default=0.0, ge=0.0)


class DonorHit(BaseModel):
    entry: DonorEntry
    similarity: float


def point_id(request_id: str) -> str:
    return str(uuid.uuid5(_POINT_NAMESPACE, request_id))


class DonorIndex:
    def __init__(self, client: QdrantClient, collection: str, dim: int, *, server: bool = False) -> None:
        self.client = client
        self.collection = collection
        self.dim = dim
        self.server = server

    @classmethod
    def connect(
        cls, *, url: str = "", path: str | Path = "", api_key: str | None = None, collection: str, dim: int
    ) -> DonorIndex:
        """A server at ``url`` if given, else Qdrant local mode at ``path`` (``:memory:`` for none)."""
        if url:
            client = QdrantClient(url=url, api_key=api_key)
        elif str(path) == ":memory:":
            client = QdrantClient(location=":memory:")
        else:
            Path(path).mkdir(parents=True, exist_ok=True)
            client = QdrantClient(path=str(path))
        index = cls(client, collection, dim, server=bool(url))
        index.ensure_collection()
        return index

    def ensure_collection(self) -> None:
        if self.client.collection_exists(self.collection):
            return
        self.client.create_collection(
            self.collection, vectors_config=qm.VectorParams(size=self.dim, distance=qm.Distance.COSINE)
        )
        # Local mode scans payloads and has no payload indexes; a server needs them to filter fast.
        for field in ("compat_key", "tenant") if self.server else ():
            self.client.create_payload_index(self.collection, field, qm.PayloadSchemaType.KEYWORD)

    def upsert(self, entry: DonorEntry, vector: Sequence[float]) -> None:
        if len(vector) != self.dim:
            raise ValueError(f"vector has {len(vector)} dimensions, the index {self.dim}")
        self.client.upsert(
            self.collection,
            points=[
                qm.PointStruct(id=point_id(entry.request_id), vector=list(vector), payload=entry.model_dump())
            ],
            wait=True,
        )

    def search(
        self, vector: Sequence[float], *, compat_key: str, tenant: str | None, limit: int = 5
    ) -> list[DonorHit]:
        """Nearest donors with this compatibility key; ``tenant=None`` searches every tenant."""
        must: list[qm.Condition] = [
            qm.FieldCondition(key="compat_key", match=qm.MatchValue(value=compat_key))
        ]
        if tenant is not None:
            must.append(qm.FieldCondition(key="tenant", match=qm.MatchValue(value=tenant)))
        response = self.client.query_points(
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
        points = self.client.retrieve(self.collection, ids=[point_id(request_id)], with_payload=True)
        return DonorEntry.model_validate(points[0].payload) if points else None

    def update(self, entry: DonorEntry) -> None:
        """Overwrite an existing entry's payload (hits, last use) without touching its vector."""
        self.client.overwrite_payload(
            self.collection, payload=entry.model_dump(), points=[point_id(entry.request_id)], wait=True
        )

    def delete(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self.client.delete(
                self.collection,
                points_selector=qm.PointIdsList(points=[point_id(r) for r in request_ids]),
                wait=True,
            )

    def entries(self, batch: int = 256) -> Iterator[DonorEntry]:
        offset: qm.ExtendedPointId | None = None
        while True:
            points, offset = self.client.scroll(
                self.collection, limit=batch, offset=offset, with_payload=True, with_vectors=False
            )
            for p in points:
                yield DonorEntry.model_validate(p.payload)
            if offset is None:
                return

    def count(self) -> int:
        return self.client.count(self.collection, exact=True).count

    def close(self) -> None:
        self.client.close()
