"""The benchmarked server's peak memory, sampled while a benchmark runs: the device
memory its processes hold on a GPU (nvidia-smi), else their resident memory (RSS).

A benchmark drives a server over HTTP and cannot ask it; when the server runs on this
machine its processes are found by the port it listens on (or given by pid), and read
from /proc: no library, so the product's benchmark needs nothing beyond the gateway's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def listening_pid(port: int) -> int | None:
    """The pid of this user's process listening on TCP `port`, from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            # local address "ADDR:PORT" in hex, state 0A: LISTEN
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                return int(pid)
        except OSError:
            continue
    return None


def server_pid(url: str) -> int | None:
    """The pid serving `url` when it is on this machine, else None."""
    parsed = urlparse(url)
    if parsed.hostname not in LOOPBACK:
        return None
    return listening_pid(parsed.port or (443 if parsed.scheme == "https" else 80))


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (worker processes, tensor-parallel ranks)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return tree


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def device_bytes(pids: list[int]) -> int | None:
    """GPU memory the processes hold (nvidia-smi), None without a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = 0
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids:
            used += int(mib) << 20
    return used


@dataclass
class PeakMemory:
    kind: str  # "device" (GPU memory) or "rss"
    bytes: int
    pid: int


class MemorySampler:
    """Samples a server's memory every `interval` seconds in a thread until stop()."""

    def __init__(self, pid: int | None, interval: float = 0.25) -> None:
        self.pid, self.interval = pid, interval
        self.peak_rss = 0
        self.peak_device: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        pids = process_tree(self.pid)
        self.peak_rss = max(self.peak_rss, rss_bytes(pids))
        used = device_bytes(pids)
        if used is not None:
            self.peak_device = max(self.peak_device or 0, used)

    def _run(self) -> None:
        self._sample()
        while not self._done.wait(self.interval):
            self._sample()
        self._sample()

    def figures(self) -> dict[str, float]:
        """The peak as a history figure (peak_device_bytes or peak_rss_bytes)."""
        peak = self.peak()
        return {f"peak_{peak.kind}_bytes": float(peak.bytes)} if peak else {}

    def peak(self) -> PeakMemory | None:
        """Device memory when the server held any, else RSS; None: no server found."""
        if self.pid is None:
            return None
        if self.peak_device:
            return PeakMemory("device", self.peak_device, self.pid)
        return PeakMemory("rss", self.peak_rss, self.pid)
