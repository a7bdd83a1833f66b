"""Ports for the servers the suite and the studies start, drawn from below the kernel's
ephemeral range.

A port the kernel hands out for `bind(0)` comes from the same range it draws the
source ports of outgoing connections from, so between a test taking such a port and
its server binding it, any client connection on the machine may take it (a CI run
failed so: `kvgate serve` found its port in use). Ports below that range are never
handed out by the kernel; each xdist worker walks a block of its own (a study the
suite runs, in the worker's environment, walks the same block from another start), and
each is checked free by binding before it is given. The tests and the studies
(studies/harness.py) take their ports here."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator

_BLOCK = 1500  # ports a worker walks through before it starts over
_WORKERS = 8


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _candidates() -> Iterator[int] | None:
    low = _ephemeral_low()
    first = low - _BLOCK * _WORKERS
    if first < 1024:  # no room below this machine's range: let the kernel choose
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    base = first + (int(worker) % _WORKERS if worker.isdigit() else 0) * _BLOCK
    start = os.getpid() % _BLOCK  # two runs side by side start apart
    return (base + (start + i) % _BLOCK for i in itertools.count())


_PORTS = _candidates()


def free_port() -> int:
    """A port nothing listens on now and that no outgoing connection will take."""
    for _ in range(_BLOCK if _PORTS is not None else 0):
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
