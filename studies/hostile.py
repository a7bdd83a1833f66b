"""Hostile input against a real gateway: the reliability figures of issue 13.

    python -m studies.hostile [--postgres] [--parts bad,stall,kill9] [--out FILE] [--plot FILE]

A gateway that many tenants share meets careless and hostile clients, and each of
them must cost it no more than a 4xx. This starts real `kvgate serve --backend fake`
processes (on SQLite, or with --postgres on PostgreSQL in a fresh schema) and measures:

1. bad inputs: a catalogue of hostile requests (studies/hostile_cases.py), each sent
   over a real socket: how many were tried and of which kinds, how many got a 5xx, a
   non-JSON error body, no answer or an answer a correct gateway would not give, and
   how many Tracebacks the gateway logged meanwhile (goal: no 5xx);
2. event-loop stall: a prober sends `GET /health` every few ms while a fan-out attack
   and then a compression attack run; the longest and p99 health-check latency of
   each, beside a quiet baseline from the same run (goal: under 50 ms);
3. kill -9 under load: clients send chats, the gateway is killed mid-load and
   restarted on the same database; responses received whole whose request id has no
   usage row are the usage rows lost (goal 0). Rows of requests that no client
   received whole (billed, not delivered) are counted apart.

It prints a table, writes the figures to --out (JSON) and the stall timeline to --plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from bench.options import DefaultsHelpFormatter
from studies.harness import ADMIN_KEY, free_port, make_tenant, stop_process
from studies.hostile_cases import catalogue
from studies.hostile_http import Case, Ctx, classify, gzip_zeros, judge, summarize
from studies.hostile_load import (
    Attack,
    Prober,
    attack_windows,
    billed_not_delivered,
    load_then_kill,
    lost_rows,
    window_stats,
)
from studies.hostile_report import plot, print_table

PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
TENANTS = {
    "main": {},
    "other": {},
    "tpm100": {"tpm": 100},
    "tpm1000": {"tpm": 1000},
    "rpm1": {"rpm": 1},
}


@dataclass
class Database:
    url: str
    schema: str | None = None  # PostgreSQL: a fresh schema, dropped afterwards

    @classmethod
    def fresh(cls, args: argparse.Namespace, tmp: Path, name: str) -> Database:
        if not args.postgres:
            for stale in tmp.glob(f"{name}.db*"):  # a --workdir kept from an earlier run
                stale.unlink()
            return cls(f"sqlite+aiosqlite:///{tmp / name}.db")
        schema = "kvgate_hostile_" + secrets.token_hex(4)
        _pg(args.database_url, f'CREATE SCHEMA "{schema}"')
        return cls(args.database_url, schema)

    def drop(self) -> None:
        if self.schema is not None:
            _pg(self.url, f'DROP SCHEMA "{self.schema}" CASCADE')

    def request_ids(self) -> set[str]:
        """Every request id in usage_records, read from the database itself."""
        if self.schema is None:
            with closing(sqlite3.connect(self.url.removeprefix("sqlite+aiosqlite:///"))) as db:
                return {row[0] for row in db.execute("SELECT request_id FROM usage_records")}
        rows = _pg(self.url, f'SELECT request_id FROM "{self.schema}".usage_records')
        return {row[0] for row in rows}


def _pg(url: str, sql: str) -> list:
    import asyncpg

    async def run() -> list:
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            return await conn.fetch(sql)
        finally:
            await conn.close()

    return asyncio.run(run())


@dataclass
class Gateway:
    """One `kvgate serve --backend fake` process; `start` again restarts it, same database."""

    db: Database
    log: Path
    slow_timeout_s: float
    port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> Gateway:
        env = dict(
            os.environ,
            KVGATE_ADMIN_KEY=ADMIN_KEY,
            PYTHONUNBUFFERED="1",
            KVGATE_HEADER_TIMEOUT_S=str(self.slow_timeout_s),
            KVGATE_BODY_TIMEOUT_S=str(self.slow_timeout_s),
        )
        if self.db.schema is not None:
            env["KVGATE_DATABASE_SCHEMA"] = self.db.schema
        self.port = free_port()
        started = self.text().count("listening on")
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gateway.cli",
                    "--database-url",
                    self.db.url,
                    "serve",
                    "--backend",
                    "fake",
                    "--port",
                    str(self.port),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while self.text().count("listening on") == started:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvgate serve did not start:\n{self.text()[-3000:]}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tracebacks(self, since: int = 0) -> int:
        return self.text()[since:].count("Traceback")

    def tenant(self, name: str, **quota: int) -> tuple[str, str]:
        """A tenant made through the admin API, and a key for it."""
        return make_tenant(self.url, name, **quota)


@contextmanager
def fresh_gateway(tmp: Path, args: argparse.Namespace, name: str) -> Iterator[Gateway]:
    """A gateway on a database of its own, stopped and the database dropped afterwards."""
    db = Database.fresh(args, tmp, name)
    gw = Gateway(db, tmp / f"{name}.log", args.slow_timeout)
    gw.log.unlink(missing_ok=True)
    try:
        yield gw.start()
    finally:
        gw.stop()
        db.drop()


def run_bad_inputs(tmp: Path, args: argparse.Namespace) -> dict:
    cases = [c for c in catalogue() if not args.cases or c.name in args.cases]
    unknown = set(args.cases or ()) - {c.name for c in cases}
    if unknown:
        raise SystemExit(f"no such cases: {sorted(unknown)}")
    with fresh_gateway(tmp, args, "bad_inputs") as gw:
        tenants = {label: gw.tenant(label, **quota) for label, quota in TENANTS.items()}
        bomb = gzip_zeros(args.bomb_mib) if any(c.kind == "compression" for c in cases) else b""
        rows = asyncio.run(_send_cases(gw, cases, tenants, bomb, args))
    return summarize(rows) | {
        "log_tracebacks": gw.tracebacks(),
        "bomb_mib": args.bomb_mib,
        "bomb_bytes": len(bomb),
    }


async def _send_cases(
    gw: Gateway,
    cases: list[Case],
    tenants: dict[str, tuple[str, str]],
    bomb: bytes,
    args: argparse.Namespace,
) -> list[dict]:
    """Each case in turn, with the Tracebacks the gateway logged while it ran."""
    rows = []
    async with aiohttp.ClientSession() as http:
        ctx = Ctx(
            url=gw.url,
            http=http,
            keys={label: key for label, (_, key) in tenants.items()},
            tenant_ids={label: tid for label, (tid, _) in tenants.items()},
            admin_key=ADMIN_KEY,
            bomb=bomb,
            case_timeout_s=args.case_timeout,
            slow_timeout_s=args.slow_timeout,
        )
        for case in cases:
            mark = len(gw.text())
            reply = await case.send(ctx)
            await asyncio.sleep(0.05)  # what the gateway logs about it, it logs by now
            shape = classify(reply)
            rows.append(
                {
                    "name": case.name,
                    "kind": case.kind,
                    "status": reply.status,
                    "shape": shape,
                    "expected": judge(case.expect, reply.status, shape),
                    "expect": list(case.expect),
                    "seconds": round(reply.seconds, 3),
                    "tracebacks": gw.tracebacks(mark),
                    "note": reply.note,
                }
            )
            if gw.proc.poll() is not None:
                rows[-1]["note"] += f" the gateway died (exit {gw.proc.returncode})"
                break
    return rows


def _attacks(key: str, bomb: bytes, args: argparse.Namespace) -> list[Attack]:
    """Big fan-out bodies with a key; the gzip bomb with a key and without one."""
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    gz = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    fanout = {
        "model": "fake-model",
        "n": args.fanout_n,
        "max_tokens": 16,
        "prompt": [f"prompt {i}" for i in range(args.fanout_prompts)],
    }
    chat = "/v1/chat/completions"
    return [
        Attack(
            "fan-out",
            [("/v1/completions", json.dumps(fanout).encode(), auth)],
            args.attack_concurrency,
            args.attack_s,
        ),
        Attack(
            "compression",
            [(chat, bomb, gz | auth), (chat, bomb, gz)],
            args.attack_concurrency,
            args.attack_s,
        ),
    ]


def run_stall(tmp: Path, args: argparse.Namespace) -> dict:
    bomb = gzip_zeros(args.bomb_mib)  # made before the clock starts: it takes seconds
    with fresh_gateway(tmp, args, "stall") as gw:
        attacks = _attacks(gw.tenant("stall")[1], bomb, args)
        prober = Prober(gw.url, args.probe_interval_ms / 1000)
        try:
            windows = asyncio.run(attack_windows(gw.url, args.quiet_s, attacks))
        finally:
            samples = prober.stop()
    t0 = windows[0]["start"]
    for w in windows:
        w |= window_stats(samples, w["start"], w["settled"] or w["end"])
        for k in ("start", "end", "settled"):
            w[k] = None if w[k] is None else round(w[k] - t0, 3)
    return {
        "windows": windows,
        "probe_interval_ms": args.probe_interval_ms,
        "fanout": {"prompts": args.fanout_prompts, "n": args.fanout_n, "max_tokens": 16},
        "bomb_mib": args.bomb_mib,
        "bomb_bytes": len(bomb),
        "tracebacks": gw.tracebacks(),
        "samples": [[round(s.at - t0, 4), round(s.latency_s * 1000, 2), s.ok] for s in samples],
    }


def run_kill9(tmp: Path, args: argparse.Namespace) -> dict:
    with fresh_gateway(tmp, args, "kill9") as gw:
        _, key = gw.tenant("load")
        log = asyncio.run(load_then_kill(gw.url, key, args.clients, args.load_s, gw.kill9))
        gw.proc.wait()
        gw.start()  # the same database, as after a crash
        restarted = httpx.get(gw.url + "/health", timeout=30).status_code == 200
        recorded = gw.db.request_ids()
    lost = lost_rows(log.completed, recorded)
    billed = billed_not_delivered(log.completed, recorded)
    return {
        "clients": args.clients,
        "load_s": args.load_s,
        "completed": len(log.completed),
        "completed_streams": log.completed_streams,
        "incomplete": len(log.incomplete),
        "rows": len(recorded),
        "lost_rows": len(lost),
        "lost_ids": lost[:20],
        "billed_not_delivered": len(billed),
        "errors_before_kill": dict(log.errors_before_kill),
        "id_mismatches": log.id_mismatches,
        "restarted": restarted,
        "tracebacks": gw.tracebacks(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--postgres", action="store_true", help="PostgreSQL, in fresh schemas")
    p.add_argument("--database-url", default=PG_URL, help="with --postgres")
    p.add_argument("--parts", default="bad,stall,kill9", help="any of bad, stall, kill9")
    p.add_argument("--cases", help="only these part-1 cases (comma-separated names)")
    p.add_argument("--case-timeout", type=float, default=10, help="s to wait for an answer")
    p.add_argument(
        "--slow-timeout",
        type=float,
        default=3,
        help="the gateway's header and body timeouts (s), for half-sent requests",
    )
    p.add_argument("--bomb-mib", type=int, default=1024, help="zeros in the gzip bomb (MiB)")
    p.add_argument("--quiet-s", type=float, default=3, help="the stall baseline's length")
    p.add_argument("--attack-s", type=float, default=5, help="each attack's length")
    p.add_argument("--attack-concurrency", type=int, default=4)
    p.add_argument("--probe-interval-ms", type=float, default=5)
    p.add_argument("--fanout-prompts", type=int, default=500)
    p.add_argument("--fanout-n", type=int, default=128)
    p.add_argument("--clients", type=int, default=32, help="kill -9 part: load clients")
    p.add_argument("--load-s", type=float, default=3, help="kill -9 part: load before the kill")
    p.add_argument("--out", help="JSON file (default docs/perf/hostile_<database>.json)")
    p.add_argument("--plot", help="PNG (default docs/perf/hostile_stall[_postgres].png)")
    p.add_argument("--workdir", help="keep databases and gateway logs here")
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    if not set(args.parts) <= {"bad", "stall", "kill9"}:
        p.error(f"--parts: each of bad, stall, kill9; got {args.parts}")
    args.cases = args.cases.split(",") if args.cases else None
    db = "postgres" if args.postgres else "sqlite"
    args.out = Path(args.out or f"docs/perf/hostile_{db}.json")
    args.plot = Path(args.plot or f"docs/perf/hostile_stall{'_postgres' * args.postgres}.png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = {"bad": run_bad_inputs, "stall": run_stall, "kill9": run_kill9}
    result: dict = {
        "database": "postgresql" if args.postgres else "sqlite",
        # the figures are timings on a shared machine: what else ran is part of them
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(args.workdir or d)
        tmp.mkdir(parents=True, exist_ok=True)
        for name in args.parts:
            print(f"part {name} ...", file=sys.stderr, flush=True)
            result[name] = parts[name](tmp, args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if "stall" in result:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
