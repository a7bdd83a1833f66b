"""`kvgate serve --workers N`: the gateway's engines as supervised `kvgate worker`
processes: where each runs (placement), keeping them alive (supervisor), and the pool
the gateway starts and stops (pool). The child process itself is gateway.worker.

The line a worker prints once it listens lives here, not in the supervisor that waits for
it: `kvgate worker` and every other `kvgate` command read it while building their flags,
without the supervisor's aiohttp.
"""

READY_LINE = "kvgate worker: listening on "  # a worker prints it; the supervisor waits for it
