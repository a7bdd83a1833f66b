"""A private PostgreSQL cluster in a temporary directory, on a port of its own.

The machine's shared server (127.0.0.1:5432) serves every test suite running beside a
benchmark, and cannot be restarted without breaking them. A private cluster can be
restarted under load (the outage test), is quiet (the benchmark), and preloads
`pg_stat_statements`, which counts the statements a run sent: the round trips per
request. It uses the server binaries of the Debian packages; initdb refuses to run as
root, so the cluster's processes run as the `postgres` user when this one is root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from studies.harness import free_port


def _bin_dir() -> Path | None:
    root = Path("/usr/lib/postgresql")
    versions = sorted(root.glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    return versions[-1].parent if versions else None


def available() -> bool:
    """Whether a private cluster can be made here (server binaries installed)."""
    return _bin_dir() is not None and (os.geteuid() != 0 or shutil.which("runuser") is not None)


@dataclass
class PgCluster:
    """`start()` makes and starts it; `stop()` removes it. Trust authentication on
    127.0.0.1 only, user `postgres`, database `postgres`."""

    port: int = field(default_factory=free_port)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvgate-pg-")))

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> None:
        bin_dir = _bin_dir()
        assert bin_dir is not None, "no PostgreSQL server binaries under /usr/lib/postgresql"
        argv = [str(bin_dir / cmd[0]), *cmd[1:]]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)

    def start(self) -> PgCluster:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        if not self.data.exists():
            self._run(
                "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"
            )
            conf = self.data / "postgresql.conf"
            with conf.open("a") as f:
                f.write(
                    f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.root}'\n"
                    "shared_preload_libraries = 'pg_stat_statements'\n"
                    "pg_stat_statements.track_utility = on\nmax_connections = 200\n"
                )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`immediate` is a crash: no checkpoint, clients cut off)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down for `down_s`, start again: an outage the clients must ride."""
        self.stop("immediate")
        time.sleep(down_s)
        self.start()

    def server_pids(self) -> list[int]:
        """The postmaster and its children (backends, writers): their CPU time is the
        database's share of a run."""
        head = int((self.data / "postmaster.pid").read_text().split()[0])
        out = subprocess.run(
            ["pgrep", "-P", str(head)], capture_output=True, text=True, check=False
        ).stdout
        return [head, *(int(p) for p in out.split())]

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already down
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
