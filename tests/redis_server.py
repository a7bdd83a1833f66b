"""A Redis server of a test's own: a real redis-server process on a free port, so a
test can stop it mid-run without disturbing the machine's shared one."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from studies.ports import free_port


@contextmanager
def redis_server(workdir: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """(url, process) of a fresh, empty, memory-only Redis; stopped at the end."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    raise RuntimeError("redis-server exited at start") from None
                time.sleep(0.05)
        yield url, proc
    finally:
        client.close()
        proc.kill()
        proc.wait()
