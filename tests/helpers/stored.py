"""Reading what a worker stored: its result leaves before the end of its trajectory's upload, and names the
trajectory's exact size, so a test waits for the stored objects to add up to it."""

from __future__ import annotations

import time

from workers.store import ObjectStore


def stored_objects(store: ObjectStore, prefix: str, nbytes: int, timeout_s: float = 15.0) -> dict[str, int]:
    """Key → size of the objects under ``prefix`` once they add up to ``nbytes`` (or as they are at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sizes = {o.key: o.size for o in store.list(prefix)}
        if sum(sizes.values()) == nbytes or time.monotonic() > deadline:
            return sizes
        time.sleep(0.02)
