"""The scheduler→worker contract: what the scheduler asks a worker to do, which queue it goes to, and where
workers put what they produce.

A ``WorkOrder`` is the Celery task's only argument (as JSON): the validated request, the reuse plan, the
donor to reuse (if any) and the request's role in a group; an ``EvictOrder`` names donors whose objects go.
Queue routing (one queue per catalog model, plus maintenance) and the object-store key layout of trajectories
and videos are defined here and nowhere else: the workers write that layout, the scheduler records it in the
donor index and evicts it. ``producer.broker`` puts these orders on the Celery broker.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from producer.catalog import CATALOG
from producer.contract import GenerationRequest, ReusePlan

GENERATE_TASK = "chorus.generate"


def queue_for(model: str) -> str:
    """One Celery queue per model, so a pool of workers loads exactly one model."""
    return f"chorus.{model}"


# --- object-store layout -----------------------------------------------------------------------------------
# A trajectory is ``<prefix>header.json`` (metadata and initial latent), then one ``<prefix>step-NNNN.safetensors``
# per step, or, packed, ``<prefix>header.json`` alone holding every step (``workers.donors``); a follower that gave
# up on its leader leaves ``<prefix>abandoned``. A video is one object.


def trajectory_prefix(request_id: str) -> str:
    return f"trajectories/{request_id}/"


def header_key(prefix: str) -> str:
    return f"{prefix}header.json"


def step_key(prefix: str, index: int) -> str:
    return f"{prefix}step-{index:04d}.safetensors"


def abandoned_key(prefix: str) -> str:
    return f"{prefix}abandoned"


def trajectory_header_key(request_id: str) -> str:
    return header_key(trajectory_prefix(request_id))


def trajectory_step_key(request_id: str, step: int) -> str:
    return step_key(trajectory_prefix(request_id), step)


def video_key(request_id: str, fmt: str) -> str:
    return f"videos/{request_id}.{fmt}"


class Role(StrEnum):
    SOLO = "solo"
    LEADER = "leader"  # others may follow it: upload each step as soon as it is done
    FOLLOWER = "follower"  # its donor is a leader still running: wait for each step, up to a deadline


class DonorRef(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_id: str
    similarity: float = Field(ge=-1.0, le=1.0)
    trajectory_prefix: str
    # For a follower: seconds to wait for each step the leader has not uploaded yet before running it in full.
    wait_s: float = Field(default=0.0, ge=0.0)


class WorkOrder(BaseModel):
    model_config = ConfigDict(frozen=True)

    request: GenerationRequest
    plan: ReusePlan
    donor: DonorRef | None = None
    role: Role = Role.SOLO
    accepted_at: AwareDatetime = Field(default_factory=lambda: datetime.now(UTC))


# While a worker runs an order it beats into the task's state in the Celery result backend (state PROGRESS, meta
# with this field, a unix time); the scheduler's order watchdog reads it to tell a lost order from a long one.
HEARTBEAT_FIELD = "heartbeat_at"


def heartbeat_of(meta: object) -> float | None:
    """The last heartbeat a task's state meta carries, if it carries one."""
    if isinstance(meta, dict):
        value = meta.get(HEARTBEAT_FIELD)
        if isinstance(value, int | float):
            return float(value)
    return None


EVICT_TASK = "chorus.evict"
# Workers of every model pool also consume this queue: deleting evicted donors' objects is a worker's job
# because workers own the object store; the scheduler only decides what to evict.
MAINTENANCE_QUEUE = "chorus.maintenance"


def all_queues() -> list[str]:
    """Every queue a Chorus worker may consume: one per catalog model, plus maintenance."""
    return [queue_for(m) for m in sorted(CATALOG)] + [MAINTENANCE_QUEUE]


def route(task_name: str, order_json: Any) -> str | None:
    """The queue of a task: a generate order goes to its model's queue, an eviction to maintenance, any other
    task nowhere in particular (None).

    An order whose model cannot be read goes to the maintenance queue, where any worker answers it with a
    ``failed`` result naming the problem (nothing is silently dropped).
    """
    if task_name == EVICT_TASK:
        return MAINTENANCE_QUEUE
    if task_name != GENERATE_TASK:
        return None
    try:
        model = json.loads(order_json or "")["request"]["model"]
    except (TypeError, ValueError, KeyError, IndexError):
        model = None
    return queue_for(model) if isinstance(model, str) and model in CATALOG else MAINTENANCE_QUEUE


class EvictOrder(BaseModel):
    model_config = ConfigDict(frozen=True)

    request_ids: list[str]
    reason: str = "evicted"

    @property
    def prefixes(self) -> list[str]:
        return [trajectory_prefix(r) for r in self.request_ids]
