"""Scenarios about what producers send: hostile messages of every kind among valid ones, two tenants using the
same request ids, and a burst of requests (the scheduler's peak resident memory)."""

from __future__ import annotations

import time

from producer.contract import DEFAULT_TENANT
from workers.bench.faults import traffic
from workers.bench.faults.context import Run
from workers.bench.faults.observe import group_rss_bytes

MB = 1024 * 1024
CHUNK = 200


def hostile_input(run: Run) -> None:
    """``hostile`` messages cycling through every kind in ``traffic.HOSTILE_KINDS`` (tombstones, bytes that are
    not JSON or not UTF-8, 5,001-digit numbers, wrong types, missing ids and keys, keys that disagree, unknown
    fields and models, …) and ``big_prompts`` 1 MB prompts, with a valid request after every
    ``hostile_valid_every`` of them. Every valid one should be done, every hostile one dead-lettered with the
    field and rule it broke, and the scheduler should stay up."""
    sizes = run.sizes
    stream = list(
        traffic.hostile_stream(
            run.prefix,
            sizes.hostile,
            valid_every=sizes.hostile_valid_every,
            big=sizes.big_prompts,
            seed_base=run.seed_base,
        )
    )
    run.say(f"publishing {len(stream)} messages ({sum(m.valid for m in stream)} valid)")
    for start in range(0, len(stream), CHUNK):
        run.publish(stream[start : start + CHUNK])
        run.supervise()
    run.wait_for(within_s=sizes.deadline_s, letters=True)


def tenant_id_collision(run: Run) -> None:
    """Two tenants send requests with the same ids and different prompts; each must get its own result (its own
    video), exactly once. Half the pairs are sent together, half one after the other's result."""
    sizes = run.sizes
    other = f"other-{run.prefix.rstrip('-')}"
    pairs = max(1, sizes.collision_pairs)
    together = (pairs + 1) // 2

    def pair(i: int) -> tuple[traffic.Message, traffic.Message]:
        mine = run.request(i, tenant=DEFAULT_TENANT)
        theirs = run.request(i, tenant=other, text=f"a yellow triangle moving down on a white background {i}")
        return mine, theirs

    for i in range(together):
        run.publish(pair(i))
    for i in range(together, pairs):
        first, second = pair(i)
        run.publish([first])
        run.wait_for({(first.tenant, str(first.request_id))}, within_s=sizes.deadline_s)
        run.publish([second])
    run.wait_for(within_s=sizes.deadline_s)
    run.figures["tenants"] = [DEFAULT_TENANT, other]


def burst(run: Run) -> None:
    """``burst`` requests published at once (prompts from many families); reports the scheduler's resident memory
    before and at its peak, and the throughput."""
    sizes = run.sizes
    scheduler = run.stack.schedulers[0]
    before = group_rss_bytes(scheduler.pid)
    messages = [run.request(i) for i in range(sizes.burst)]
    started = time.monotonic()
    for start in range(0, len(messages), CHUNK):
        run.publish(messages[start : start + CHUNK])
        run.supervise()
    published_s = time.monotonic() - started
    run.say(f"{len(messages)} requests published in {published_s:.1f} s")
    run.wait_for(within_s=sizes.burst_deadline_s)
    done = [r for r in run.results() if r.status == "done"]
    last = max((r.arrived_at for r in done), default=started)
    run.figures.update(
        scheduler_rss_before_mb=round(before / MB, 1),
        publish_s=round(published_s, 2),
        drain_s=round(last - started, 1),
        requests_per_s=round(len(done) / (last - started), 2) if done and last > started else None,
    )
