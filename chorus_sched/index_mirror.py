"""A search copy of a Qdrant local-mode collection, kept in memory while its process has the folder open.

Qdrant local mode answers a filtered search by checking every point's payload in Python (``chorus bench sched``:
~200 ms per request at a few hundred donors, four searches per request, growing with the index). A server uses
payload indexes; local mode has none. So while a process holds the folder (``chorus_sched.index_lock``: no other
process can write it then), ``chorus_sched.index.DonorIndex`` keeps this copy of every point, updates it with each
of its own writes, and answers searches, reads and counts from it with numpy. Qdrant's folder stays the store: the
copy is loaded from it on every open and dropped on every close.

Scores are Qdrant's for ``Distance.COSINE``: stored and query vectors normalized, then a dot product. Equal
scores (the same prompt stored twice) go newest first, by the rank each point is stored with.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

import numpy as np

Entry = TypeVar("Entry")
_FREE = -1  # the code of a deleted row


class _Codes:
    """Strings as small integers, so a filter on them is one vectorized comparison."""

    def __init__(self) -> None:
        self._codes: dict[str, int] = {}

    def code(self, value: str) -> int:
        return self._codes.setdefault(value, len(self._codes))

    def find(self, value: str) -> int | None:
        return self._codes.get(value)


class SearchMirror(Generic[Entry]):
    """Points (id → entry, vector) with three keyword fields to filter on: compat key, tenant, status."""

    def __init__(self, dim: int, capacity: int = 256) -> None:
        self.dim = dim
        self._vectors = np.zeros((capacity, dim), dtype=np.float32)
        self._fields = np.full((capacity, 3), _FREE, dtype=np.int64)  # compat key, tenant, status codes
        self._ranks = np.zeros(capacity, dtype=np.float64)  # ties: the higher rank first
        self._entries: list[Entry | None] = []
        self._rows: dict[str, int] = {}
        self._codes = (_Codes(), _Codes(), _Codes())

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, point: str) -> Entry | None:
        row = self._rows.get(point)
        return None if row is None else self._entries[row]

    def entries(self) -> list[Entry]:
        return [e for e in self._entries if e is not None]

    def put(
        self,
        point: str,
        entry: Entry,
        fields: tuple[str, str, str],
        vector: Sequence[float],
        rank: float = 0.0,
    ) -> None:
        row = self._rows.get(point)
        if row is None:
            row = len(self._entries)
            self._grow(row + 1)
            self._entries.append(entry)
            self._rows[point] = row
        else:
            self._entries[row] = entry
        v = np.asarray(vector, dtype=np.float32)
        norm = float(np.linalg.norm(v))
        self._vectors[row] = v / norm if norm > 0 else v
        self._ranks[row] = rank
        self._fields[row] = [codes.code(f) for codes, f in zip(self._codes, fields, strict=True)]

    def update(
        self, point: str, entry: Entry, fields: tuple[str, str, str], rank: float | None = None
    ) -> bool:
        """Replace an entry's payload (and rank, if given), keeping its vector; False if there is no such point."""
        row = self._rows.get(point)
        if row is None:
            return False
        self._entries[row] = entry
        if rank is not None:
            self._ranks[row] = rank
        self._fields[row] = [codes.code(f) for codes, f in zip(self._codes, fields, strict=True)]
        return True

    def remove(self, points: Iterable[str]) -> None:
        for point in points:
            row = self._rows.pop(point, None)
            if row is not None:
                self._entries[row] = None
                self._fields[row] = _FREE
        if len(self._entries) > 64 and len(self._rows) < len(self._entries) // 2:
            self._compact()

    def search(
        self, vector: Sequence[float], where: tuple[str | None, str | None, str | None], limit: int
    ) -> list[tuple[Entry, float]]:
        """The ``limit`` nearest entries whose fields equal ``where`` (None: any value), best first."""
        n = len(self._entries)
        mask = self._fields[:n, 0] != _FREE
        for column, (codes, value) in enumerate(zip(self._codes, where, strict=True)):
            if value is not None:
                code = codes.find(value)
                if code is None:
                    return []
                mask &= self._fields[:n, column] == code
        rows = np.flatnonzero(mask)
        if rows.size == 0 or limit <= 0:
            return []
        query = np.asarray(vector, dtype=np.float32)
        norm = float(np.linalg.norm(query))
        # Every stored row scored in place, then the filter: gathering the matching rows first copied them
        # (3 MB at 2,000 donors), several times the product's cost; deleted rows are scored and dropped.
        scores = (self._vectors[:n] @ (query / norm if norm > 0 else query))[rows]
        if rows.size > limit:  # only the best ``limit`` scores, and every row tied with the last, get sorted
            cut = rows.size - limit
            kept = np.flatnonzero(scores >= np.partition(scores, cut)[cut])
            rows, scores = rows[kept], scores[kept]
        best = np.lexsort((-self._ranks[rows], -scores))[:limit]  # by score, then by rank
        out = []
        for i in best:
            entry = self._entries[int(rows[i])]
            assert entry is not None
            out.append((entry, float(scores[i])))
        return out

    def _grow(self, size: int) -> None:
        capacity = self._vectors.shape[0]
        if size <= capacity:
            return
        new = max(size, 2 * capacity)
        self._vectors = np.concatenate([self._vectors, np.zeros((new - capacity, self.dim), np.float32)])
        self._fields = np.concatenate([self._fields, np.full((new - capacity, 3), _FREE, np.int64)])
        self._ranks = np.concatenate([self._ranks, np.zeros(new - capacity, np.float64)])

    def _compact(self) -> None:
        keep = sorted(self._rows.values())
        self._vectors = np.ascontiguousarray(self._vectors[keep])
        self._fields = np.ascontiguousarray(self._fields[keep])
        self._ranks = np.ascontiguousarray(self._ranks[keep])
        self._entries = [self._entries[r] for r in keep]
        order = {old: new for new, old in enumerate(keep)}
        self._rows = {point: order[row] for point, row in self._rows.items()}
