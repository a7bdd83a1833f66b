"""Gateways on PostgreSQL against one on SQLite: the cost of sharing the database.

    python -m studies.pg_gateways [--rounds 2] [--out docs/perf/pg_gateways.json] [--plot ...]

Everything runs on a private PostgreSQL cluster (studies.pg_cluster), so the database is
quiet and `pg_stat_statements` counts the statements each load sent. Three parts:

1. paced fake backend (TTFT 50 ms, 50 tokens/s): one gateway on SQLite and one on
   PostgreSQL at 1 and 64 concurrent streams, alternating which goes first per round;
   requests/s, TTFT, CPU seconds per request (the gateway, plus the PostgreSQL server's
   processes for the PostgreSQL one) and statements per request;
2. unpaced: one gateway on PostgreSQL against two on the same database, loads sent to
   each at once: requests/s;
3. exactness: a tenant allowed 50 requests a minute sends 300 at once, split over the two
   gateways: how many were admitted (exactly 50 is right).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import asyncpg

from bench.datasets import random_requests
from bench.options import DefaultsHelpFormatter
from studies.harness import Process, start_gateway, tenant_key
from studies.pg_cluster import PgCluster
from studies.scale_out_procs import Run, cpu_seconds, measure

PACED = '[[backends]]\nname = "fake"\ntype = "fake"\noptions = { ttft_ms = 50, tokens_per_second = 50 }\n'
UNPACED = '[[backends]]\nname = "fake"\ntype = "fake"\n'


@dataclass
class Level:
    """One load on one gateway, with its database's share."""

    run: Run
    database: str
    cpu_per_request_ms: float  # gateway + database server
    db_cpu_per_request_ms: float  # the database server's share (0 on SQLite)
    statements_per_request: float | None  # None on SQLite


def start(workdir: Path, name: str, config: str, database_url: str) -> Process:
    env = {"KVGATE_DATABASE_URL": database_url, "KVGATE_INSTANCE": name}
    return start_gateway(workdir, name, config, env=env)


def pg_cpu(cluster: PgCluster) -> float:
    """CPU seconds of the server so far: its live processes and those it reaped."""
    pids = cluster.server_pids()
    head = Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()
    reaped = (int(head[13]) + int(head[14])) / os.sysconf("SC_CLK_TCK")
    return reaped + sum(cpu_seconds(p) for p in pids if Path(f"/proc/{p}").exists())


async def _sql(cluster: PgCluster, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(cluster.dsn)
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


def statements(cluster: PgCluster) -> tuple[int, list[dict]]:
    """Calls counted since the last reset, and the busiest statements."""
    rows = asyncio.run(
        _sql(
            cluster,
            "SELECT calls, left(regexp_replace(query, '\\s+', ' ', 'g'), 120) AS query "
            "FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%' "
            "ORDER BY calls DESC",
        )
    )
    return sum(r["calls"] for r in rows), [dict(r) for r in rows[:12]]


def reset_statements(cluster: PgCluster) -> None:
    asyncio.run(_sql(cluster, "SELECT pg_stat_statements_reset()"))


def paced_level(
    gw: Process, keys: list[str], cluster: PgCluster | None, concurrency: int, n: int
) -> tuple[Level, list[dict]]:
    requests = random_requests(n, 128, 32, seed=concurrency)
    if cluster is not None:
        reset_statements(cluster)
        db_before = pg_cpu(cluster)
    run = measure(
        gw.url, keys, "fake-model", requests, concurrency, gw.name, {"gateway": gw.proc.pid}
    )
    db_cpu, per_request, top = 0.0, None, []
    if cluster is not None:
        db_cpu = pg_cpu(cluster) - db_before
        calls, top = statements(cluster)
        per_request = calls / run.requests
    cpu = run.cpu_s["gateway"] + db_cpu
    ms = 1000 / run.requests
    database = "postgres" if cluster else "sqlite"
    level = Level(run, database, cpu * ms, db_cpu * ms, per_request)
    return level, top


def concurrent_loads(gateways: list[Process], keys: list[str], n: int, c: int) -> float:
    """The same load sent to each gateway at once; total requests/s."""
    runs: list[Run] = []
    threads = [
        threading.Thread(
            target=lambda g=g: runs.append(
                measure(g.url, keys, "fake-model", random_requests(n, 128, 32), c, g.name)
            )
        )
        for g in gateways
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(r.requests for r in runs) / max(r.duration_s for r in runs)


async def _burst(urls: list[str], key: str, n: int) -> dict[int, int]:
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def one(i: int) -> int:
            async with s.post(
                urls[i % len(urls)] + "/v1/completions", json=body, headers=headers
            ) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(n)))
    return {code: statuses.count(code) for code in sorted(set(statuses))}


def exactness(gateways: list[Process], rpm: int, n: int) -> dict:
    key = tenant_key(gateways[0].url, "exact", rpm=rpm)
    left = 60 - time.time() % 60
    if left < 15:  # one UTC minute for the whole burst
        time.sleep(left + 0.5)
    statuses = asyncio.run(_burst([g.url for g in gateways], key, n))
    return {"rpm": rpm, "sent": n, "statuses": statuses, "exact": statuses.get(200) == rpm}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--out", default="docs/perf/pg_gateways.json")
    ap.add_argument(
        "--plot",
        nargs="+",
        metavar="JSON",
        help="no run: plot these results (e.g. before and after a change) beside each other "
        "into --out's .png",
    )
    args = ap.parse_args(argv)
    if args.plot:
        plot({Path(p).stem: json.loads(Path(p).read_text()) for p in args.plot}, Path(args.out))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-pg-bench-"))
    cluster = PgCluster().start()
    procs: list[Process] = []
    try:
        asyncio.run(_sql(cluster, "CREATE EXTENSION pg_stat_statements"))
        sqlite = start(workdir, "sqlite", PACED, f"sqlite+aiosqlite:///{workdir}/kvgate.db")
        pg = start(workdir, "postgres", PACED, cluster.url)
        procs += [sqlite, pg]
        keys = {g.name: [tenant_key(g.url, f"t{i}") for i in range(4)] for g in (sqlite, pg)}
        levels, tops = [], {}
        for r in range(args.rounds):
            order = [(sqlite, None), (pg, cluster)]
            for gw, cl in order if r % 2 == 0 else order[::-1]:
                for c in (1, 64):
                    level, top = paced_level(gw, keys[gw.name], cl, c, c * args.requests_per_stream)
                    levels.append(level)
                    tops[f"{gw.name}-{c}"] = top
                    print(f"round {r} {gw.name} c={c}: {summary(level)}", flush=True)
        for p in (sqlite, pg):
            p.stop()
        one = start(workdir, "pg1", UNPACED, cluster.url)
        procs.append(one)
        keys1 = [tenant_key(one.url, f"u{i}") for i in range(4)]
        alone = concurrent_loads([one], keys1, 400, 32)
        two = start(workdir, "pg2", UNPACED, cluster.url)
        procs.append(two)
        both = concurrent_loads([one, two], keys1, 400, 32)
        exact = exactness([one, two], 50, 300)
        out = {
            "paced": [asdict(lv) | {"run": _trim(lv.run)} for lv in levels],
            "top_statements": tops,
            "unpaced_rps": {"one_gateway": alone, "two_gateways": both},
            "exactness": exact,
        }
        print(json.dumps(out["unpaced_rps"]), json.dumps(exact), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    finally:
        for p in procs:
            p.stop()
        cluster.remove()
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    return 0


def plot(results: dict[str, dict], out: Path) -> None:
    """Requests/s, CPU per request and statements per request at 64 streams, per result
    file and database (medians over the rounds)."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    labels, cols = [], {"rps": [], "cpu": [], "stmt": []}
    for name, result in results.items():
        for db in ("sqlite", "postgres"):
            at64 = [
                lv
                for lv in result["paced"]
                if lv["database"] == db and lv["run"]["concurrency"] == 64
            ]
            labels.append(f"{name}\n{db}")
            cols["rps"].append(
                statistics.median(lv["run"]["requests"] / lv["run"]["duration_s"] for lv in at64)
            )
            cols["cpu"].append(statistics.median(lv["cpu_per_request_ms"] for lv in at64))
            cols["stmt"].append(statistics.median(lv["statements_per_request"] or 0 for lv in at64))
    titles = {
        "rps": "requests/s (64 streams)",
        "cpu": "CPU ms per request (gateway + database)",
        "stmt": "statements per request (PostgreSQL)",
    }
    for ax, (key, values) in zip(axes, cols.items(), strict=True):
        ax.bar(
            range(len(values)),
            values,
            color=["#8aa" if "sqlite" in lb else "#458" for lb in labels],
        )
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_title(titles[key], fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def _trim(run: Run) -> dict:
    d = asdict(run)
    d.pop("ttfts_ms")
    return d


def summary(lv: Level) -> str:
    r = lv.run
    rps = r.requests / r.duration_s
    spr = "" if lv.statements_per_request is None else f" {lv.statements_per_request:.2f} stmt/req"
    return (
        f"{rps:.2f} req/s, TTFT p50 {r.ttft_p50_ms:.1f} ms p99 {r.ttft_p99_ms:.1f} ms, "
        f"{lv.cpu_per_request_ms:.2f} ms CPU/req (database {lv.db_cpu_per_request_ms:.2f}){spr}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
