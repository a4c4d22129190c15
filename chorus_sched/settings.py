"""The scheduler's configuration (environment prefix ``CHORUS_``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from producer.settings import KafkaSettings


class SchedulerSettings(KafkaSettings):
    # --- Kafka -------------------------------------------------------------------------------------------
    # Consumer group on the requests topic (instances of one deployment share it and split the partitions).
    kafka_group_id: str = "chorus-scheduler"
    # Consumer group on the results topic: each result is handled by one scheduler instance.
    kafka_results_group_id: str = "chorus-scheduler-results"
    poll_timeout_ms: int = Field(default=250, ge=1, le=60_000)
    # How often the consumers refresh topic metadata: a topic created after the scheduler started (the demo
    # creates topics on first publish) is picked up, and its partitions assigned, within this time.
    kafka_metadata_max_age_ms: int = Field(default=5000, ge=100)
    # An instance that stops heartbeating loses its partitions to the others after this long (the broker's
    # group.min.session.timeout.ms, 6 s by default, is the floor); heartbeats go out at a third of it.
    kafka_session_timeout_ms: int = Field(default=10_000, ge=1000)
    # Longest pause between two polls before the group counts an instance as stuck (also how long a rebalance
    # waits for members to rejoin); one poll's batch must be scheduled well within it.
    kafka_max_poll_interval_ms: int = Field(default=60_000, ge=1000)
    # Messages per poll; the prompts of one poll are embedded as one batch.
    poll_max_records: int = Field(default=64, ge=1, le=10_000)
    # Identifies this instance in the ledger (claims, locks) and logs; empty: host name and process id.
    instance_id: str = ""

    # --- Backing services ----------------------------------------------------------------------------------
    # Celery broker the scheduler dispatches to. Empty means the embedded filesystem transport under state_dir.
    broker_url: str = ""
    # Idempotency ledger and group coordination. Empty means an embedded SQLite store under state_dir.
    redis_url: str = ""
    ledger_prefix: str = "chorus:"
    # How long the ledger remembers a request id (and so recognizes a redelivered message).
    ledger_ttl_s: int = Field(default=7 * 24 * 3600, ge=60)
    # A claim on a request being scheduled expires after this long, so an instance that crashed mid-way
    # does not block the request forever; another instance then takes it over.
    claim_lease_s: float = Field(default=120.0, gt=0)
    # Lease of the mutexes instances take around scheduling a group and evicting: renewed while held, so it
    # bounds only how long a killed holder blocks the others.
    group_lock_lease_s: float = Field(default=10.0, gt=0, le=600)
    # Answer a request identical to one served (or running) from that one's result, with no worker compute.
    exact_hits: bool = True
    # The order watchdog (chorus_sched.watchdog): how long after sending an order it is first checked, how old a
    # started order's heartbeat may be before its worker counts as gone, how long an order may stay unstarted
    # before its message counts as lost, and how often a lost order is sent again before it is answered failed.
    order_check_after_s: float = Field(default=30.0, gt=0)
    worker_lost_after_s: float = Field(default=60.0, gt=0)
    order_pending_lost_after_s: float = Field(default=1800.0, gt=0)
    max_redispatches: int = Field(default=2, ge=0, le=20)
    # An order not started after no_worker_after_s, for a model no worker announced within worker_presence_ttl_s,
    # is answered rejected (no_worker) with a dead letter; how often the watchdog looks (apart from eviction).
    no_worker_after_s: float = Field(default=10.0, gt=0)
    worker_presence_ttl_s: float = Field(default=30.0, gt=0)
    watchdog_interval_s: float = Field(default=5.0, gt=0)
    # Qdrant server URL; empty means Qdrant local mode at qdrant_path (default: state_dir/qdrant).
    qdrant_url: str = ""
    qdrant_path: str = ""
    # Local mode: how long to wait for another process' hold on the index folder before scheduling without it
    # (full compute). Instances let go within milliseconds of being asked; a longer hold is a stuck or foreign
    # process.
    index_lock_wait_s: float = Field(default=3.0, gt=0, le=600)
    # Verified planner rows apply only while their donor checks accept often enough to pay for the rejected
    # ones (chorus_sched.reuse_gate); a paused similarity band lets one plan through this often to notice change.
    verified_gate: bool = True
    verified_gate_explore_s: float = Field(default=5.0, gt=0, le=3600)
    # Each exploration that leaves a band paused doubles its interval, up to this; reopening resets it.
    verified_gate_explore_max_s: float = Field(default=160.0, gt=0, le=86400)
    # A verified plan's check counts as rejected until its result answers, or for this long at most.
    verified_gate_pending_ttl_s: float = Field(default=120.0, gt=0, le=86400)
    # Local mode: keep the folder open between operations (opening reads every point) until another process
    # asks for it or it has been idle this long; 0 closes it after every operation.
    index_keep_open_s: float = Field(default=1.0, ge=0, le=600)
    qdrant_api_key: str | None = None
    qdrant_collection: str = "chorus_donors"
    metrics_port: int = Field(default=9101, ge=0, le=65535)
    # Address the /metrics endpoint listens on: every interface by default (Prometheus scrapes pods and hosts);
    # the local stack sets loopback.
    metrics_bind_address: str = Field(default="0.0.0.0", min_length=1)

    # --- Reuse --------------------------------------------------------------------------------------------
    # Prompt embedder: MiniLM sentence embeddings (offline package), or a dependency-free hashing embedder.
    embedder: Literal["minilm", "hashing"] = "minilm"
    # Threads MiniLM's forward passes may use (torch intra-op). One: a prompt takes ~11 ms instead of ~9 on two,
    # and the scheduler stops taking a second core from the workers beside it (their torch threads spin-wait
    # when a core is taken: chorus bench serve --trace fresh, worker CPU per request +30% with two).
    embed_threads: int = Field(default=1, ge=1, le=64)
    # MiniLM's numbers: bfloat16 on a CPU with bfloat16 instructions where it is timed faster at load (auto),
    # always float32 (the calibration's own; then on every scheduler sharing the index), or bfloat16 anyway.
    # bfloat16 costs 1.6-2.8x less CPU per prompt in batches where it pays and moves similarities by up to ~0.0045;
    # with auto or bfloat16 the planner raises its unverified rows' similarity floors by 0.005 (chorus_sched.minilm).
    embed_precision: Literal["auto", "float32", "bfloat16"] = "auto"
    # The planner's calibration table; empty means the one shipped in the package (chorus_sched/calibration.json).
    calibration_path: Path | None = None
    # Donors considered per search (the planner picks among them).
    search_limit: int = Field(default=5, ge=1, le=100)
    cross_tenant_reuse: bool = False
    # Group concurrent similar requests behind a leader (followers take its steps as they are uploaded).
    grouping: bool = True
    # A follower waits at most this long for each step its leader has not uploaded yet, then runs it in full.
    follower_wait_s: float = Field(default=30.0, ge=0)
    # A leader whose result has not arrived after this long is dropped from the index (its worker is gone).
    leader_stale_s: float = Field(default=1800.0, gt=0)

    # --- Donor cache ---------------------------------------------------------------------------------------
    # Byte budget of all donor trajectories together; the least valuable are evicted beyond it.
    cache_budget_bytes: int = Field(default=10 * 1024**3, ge=0)
    # A donor unused (no hit) for this long is evicted whatever its value.
    donor_ttl_s: float = Field(default=7 * 24 * 3600, gt=0)
    # A donor's value halves for every half-life it goes unused.
    cache_half_life_s: float = Field(default=24 * 3600, gt=0)
    # Value credited to a donor before any hit, as a fraction of its steps (so a new donor is not evicted first).
    cache_new_entry_credit: float = Field(default=0.25, ge=0, le=1)
    evict_interval_s: float = Field(default=30.0, gt=0)

    # --- Failure handling ---------------------------------------------------------------------------------
    # A request whose scheduling fails for a reason other than an unreachable service is retried this many
    # times, then dead-lettered with the error (an unreachable service is retried without limit).
    max_attempts: int = Field(default=5, ge=1, le=100)
    retry_backoff_max_s: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _lease_outlasts_poll(self) -> Self:
        if self.claim_lease_s * 1000 <= self.poll_timeout_ms:
            raise ValueError("CHORUS_CLAIM_LEASE_S must be longer than one poll (CHORUS_POLL_TIMEOUT_MS)")
        return self

    @property
    def resolved_instance_id(self) -> str:
        return self.instance_id or f"{socket.gethostname()}-{os.getpid()}"

    @property
    def resolved_qdrant_path(self) -> str:
        return self.qdrant_path or str(Path(self.state_dir) / "qdrant")

    @property
    def ledger_path(self) -> Path:
        return Path(self.state_dir) / "ledger.sqlite3"
