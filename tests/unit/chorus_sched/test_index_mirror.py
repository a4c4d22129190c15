"""The search copy answers as Qdrant does: same points, same order, same scores, through writes and deletes."""

from __future__ import annotations

import random

import pytest
from qdrant_client import QdrantClient
from qdrant_client.http import models as qm

from chorus_sched.index_mirror import SearchMirror

DIM = 8
KEYS, TENANTS, STATUSES = ["k1", "k2"], ["t", "u", "v"], ["ready", "running"]


def _qdrant_search(
    client: QdrantClient, vector: list[float], where: tuple[str | None, ...], limit: int
) -> list[tuple[str, float]]:
    must: list[qm.Condition] = [
        qm.FieldCondition(key=name, match=qm.MatchValue(value=value))
        for name, value in zip(("compat_key", "tenant", "status"), where, strict=True)
        if value is not None
    ]
    response = client.query_points(
        "c", query=vector, query_filter=qm.Filter(must=must), limit=limit, with_payload=True
    )
    return [(str(p.id), float(p.score)) for p in response.points]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_searches_match_qdrant_local_mode_through_writes_and_deletes(seed: int) -> None:
    rng = random.Random(seed)
    client = QdrantClient(location=":memory:")
    client.create_collection("c", vectors_config=qm.VectorParams(size=DIM, distance=qm.Distance.COSINE))
    mirror: SearchMirror[str] = SearchMirror(DIM, capacity=4)  # small: growing and compacting both happen
    alive: list[int] = []
    for step in range(300):
        action = rng.random()
        if action < 0.6 or not alive:  # a new point, or a point written again with another vector
            pid = rng.randrange(400)
            fields = (rng.choice(KEYS), rng.choice(TENANTS), rng.choice(STATUSES))
            vector = [rng.gauss(0, 1) for _ in range(DIM)]
            payload = dict(zip(("compat_key", "tenant", "status"), fields, strict=True))
            client.upsert("c", points=[qm.PointStruct(id=pid, vector=vector, payload=payload)], wait=True)
            mirror.put(str(pid), str(pid), fields, vector, rank=step)
            alive.append(pid)
        elif action < 0.75:  # a payload changed in place
            pid = rng.choice(alive)
            fields = (rng.choice(KEYS), rng.choice(TENANTS), rng.choice(STATUSES))
            payload = dict(zip(("compat_key", "tenant", "status"), fields, strict=True))
            client.overwrite_payload("c", payload=payload, points=[pid], wait=True)
            assert mirror.update(str(pid), str(pid), fields)
        else:
            gone = rng.sample(alive, k=min(len(alive), rng.randint(1, 6)))
            client.delete("c", points_selector=qm.PointIdsList(points=list(gone)), wait=True)
            mirror.remove(str(p) for p in gone)
            alive = [p for p in alive if p not in gone]
        if step % 10 == 0:
            query = [rng.gauss(0, 1) for _ in range(DIM)]
            where = (rng.choice(KEYS), rng.choice([*TENANTS, None]), rng.choice([*STATUSES, None]))
            expected = _qdrant_search(client, query, where, limit=5)
            got = [(entry, score) for entry, score in mirror.search(query, where, limit=5)]
            assert [e for e, _ in got] == [e for e, _ in expected], (step, where)
            assert [s for _, s in got] == pytest.approx([s for _, s in expected], abs=1e-5)
    assert len(mirror) == client.count("c", exact=True).count
    assert sorted(mirror.entries(), key=int) == [str(p) for p in sorted(set(alive))]


def test_unknown_values_and_missing_points() -> None:
    mirror: SearchMirror[str] = SearchMirror(2)
    mirror.put("a", "A", ("k", "t", "ready"), [1.0, 0.0])
    assert mirror.search([1.0, 0.0], ("other", None, None), 5) == []
    assert mirror.search([1.0, 0.0], ("k", "t", "ready"), 0) == []
    assert mirror.update("missing", "M", ("k", "t", "ready")) is False
    assert mirror.get("missing") is None
    mirror.remove(["a", "missing"])
    assert len(mirror) == 0 and mirror.search([1.0, 0.0], ("k", None, None), 5) == []


def test_equal_scores_go_highest_rank_first() -> None:
    mirror: SearchMirror[str] = SearchMirror(2)
    for name, rank in (("old", 1.0), ("new", 3.0), ("mid", 2.0)):
        mirror.put(name, name, ("k", "t", "ready"), [0.6, 0.8], rank=rank)  # the same prompt stored thrice
    assert [e for e, _ in mirror.search([0.6, 0.8], ("k", None, None), 3)] == ["new", "mid", "old"]
    assert mirror.update("old", "old", ("k", "t", "ready"), rank=4.0)  # finalized later
    assert [e for e, _ in mirror.search([0.6, 0.8], ("k", None, None), 2)] == ["old", "new"]


def test_ties_at_the_cut_go_highest_rank_first_among_many_rows() -> None:
    rng = random.Random(7)
    mirror: SearchMirror[str] = SearchMirror(2, capacity=4)
    names = [f"p{i}" for i in range(40)]
    rng.shuffle(names)
    for name in names:  # the same prompt forty times, stored in a random order, beside other prompts
        mirror.put(name, name, ("k", "t", "ready"), [0.6, 0.8], rank=float(name[1:]))
        mirror.put(f"x{name}", f"x{name}", ("k", "t", "ready"), [rng.gauss(0, 1), rng.gauss(0, 1)])
    assert [e for e, _ in mirror.search([0.6, 0.8], ("k", None, None), 3)] == ["p39", "p38", "p37"]
    assert [e for e, _ in mirror.search([0.6, 0.8], ("k", None, None), 1)] == ["p39"]
