"""``chorus bench serve`` (a trace through the embedded stack, with and without reuse) and ``chorus bench sched``
(the scheduler's own cost per request)."""
