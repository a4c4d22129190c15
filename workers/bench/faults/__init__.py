"""``chorus bench faults``: fault scenarios on the embedded stack, each bounded in time and count, reported as JSON.

- ``traffic``: the messages published (valid toy requests; hostile messages of every kind);
- ``observe``: the results and dead-letter topics read from their beginning, and ``/proc`` (pool processes, RSS);
- ``accounting``: the pure count of what was sent against what came back, and the verdict (``ok``);
- ``context``: one scenario's handle on the stack (publish, wait, kill, restart; supervision of crashes);
- ``kills``, ``stores``, ``inputs``: the scenarios;
- ``harness``: runs scenarios on stacks and assembles the report (``run_faults``, the Python API); ``cli``: the
  command.
"""

# The scenarios, in the order they run (``harness.SCENARIOS`` maps each to its function); here so that the command's
# help lists them without importing the harness.
NAMES = (
    "pool-process-kill",
    "worker-kill",
    "scheduler-kill",
    "s3-down-30s",
    "s3-hang",
    "index-unavailable",
    "corrupt-donor",
    "hostile-input",
    "tenant-id-collision",
    "burst",
)
