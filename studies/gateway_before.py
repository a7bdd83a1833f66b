"""One commit's gateway against this tree's, in one run: what the request path's
changes cost or win (`python -m studies.gateway_overhead --before REV`).

Both gateways run at once, `kvgate serve --backend fake` with auth, quota (a tenant
whose limits never bind) and a usage row per request on SQLite, each one process pinned
to CPU 0; REV's from a `git worktree` of it (on this tree's virtual environment), this
tree's from its working tree (or `--after REV`'s worktree). wrk on CPU 1 loads one at a
time, for each case (chat or text completions, whole or streamed, c connections) in the
order before, after, after, before for each round, so a load that drifts over the run
falls on both sides. Each case starts with a 2-s warm-up of each server.

Per run: requests/s from wrk, and the server's own CPU time per request from /proc,
which moves less than requests/s when other jobs take the cores by turns. The ratios are
after over before: requests/s summed over the runs, and capacity (before's median CPU
per request over after's). At the end each database must hold a usage row for every
request wrk saw answered.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sqlite3
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from studies.gateway_load import (
    CHAT_PATH,
    cpu_seconds,
    start_kvgate,
    wrk,
    wrk_percentile_ms,
    wrk_requests,
    wrk_rps,
)
from studies.harness import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("before", "after")
ORDER = ("before", "after", "after", "before")  # one round: A B B A
WARM_S = 2
HELLO = "hello there"
APIS = {
    "chat": (CHAT_PATH, {"messages": [{"role": "user", "content": HELLO}]}),
    "completions": ("/v1/completions", {"prompt": HELLO}),
}
MODES = ("whole", "stream")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def request(api: str, mode: str) -> tuple[str, dict]:
    """The path and body of a case: 16 tokens; streamed with the usage chunk, as the
    OpenAI clients ask for it."""
    path, prompt = APIS[api]
    body = {"model": "fake-model", **prompt, "max_tokens": 16}
    if mode == "stream":
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return path, body


def cases(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    return list(itertools.product(args.apis, args.modes, args.conns))


def case_name(api: str, mode: str, conns: int) -> str:
    return f"{api} {mode} c={conns}"


def _usage_rows(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT count(*) FROM usage_records").fetchone()[0]


def _measure(server: tuple, path: str, body: dict, conns: int, duration: float, tmp: Path):
    """One run against `server`: its figures, and the requests answered."""
    proc, url, key = server
    cpu = cpu_seconds(proc.pid)
    out = wrk(url, key, duration, tmp, conns, path=path, body=body)
    used, answered = cpu_seconds(proc.pid) - cpu, wrk_requests(out)
    figures = {
        "rps": wrk_rps(out),
        "cpu_us": 1e6 * used / max(answered, 1),
        "p50_ms": wrk_percentile_ms(out, "50"),
        "p99_ms": wrk_percentile_ms(out, "99"),
    }
    return figures, answered


def run(args: argparse.Namespace, tmp: Path) -> dict:
    trees = {"before": tmp / "tree-before", "after": tmp / "tree-after" if args.after else None}
    _git("worktree", "add", "--detach", str(trees["before"]), args.before)
    if args.after:
        _git("worktree", "add", "--detach", str(trees["after"]), args.after)
    servers: dict[str, tuple] = {}
    answered = dict.fromkeys(VARIANTS, 0)
    runs: dict[str, dict[str, list[dict]]] = {}
    try:
        for name in VARIANTS:
            (tmp / name).mkdir()
            port = free_port()
            proc, key = start_kvgate(port, tmp / name, None, trees[name])
            servers[name] = (proc, f"http://127.0.0.1:{port}", key)
        for api, mode, conns in cases(args):
            path, body = request(api, mode)
            case = runs[case_name(api, mode, conns)] = {name: [] for name in VARIANTS}
            for name in VARIANTS:  # warm each server and its connections for this case
                answered[name] += _measure(servers[name], path, body, conns, WARM_S, tmp)[1]
            for _ in range(args.rounds):
                for name in ORDER:
                    figures, n = _measure(servers[name], path, body, conns, args.duration, tmp)
                    answered[name] += n
                    case[name].append(figures)
                    print(f"{case_name(api, mode, conns)} {name}: {_line(figures)}", flush=True)
    finally:
        for proc, _, _ in servers.values():
            stop_process(proc)
        for tree in trees.values():
            if tree is not None:
                _git("worktree", "remove", "--force", str(tree))
    rows = {name: _usage_rows(tmp / name / "bench.db") for name in VARIANTS}
    return {"runs": runs, "answered": answered, "usage_rows": rows}


def _line(f: dict) -> str:
    return (
        f"{f['rps']:,.0f} req/s, {f['cpu_us']:,.0f} us CPU a request, "
        f"p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms"
    )


def summarize(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """Per case: each side's mean requests/s and median CPU per request, and the ratios
    (after over before)."""
    out = {}
    for case, sides in runs.items():
        rps = {n: statistics.fmean(r["rps"] for r in sides[n]) for n in VARIANTS}
        cpu = {n: statistics.median(r["cpu_us"] for r in sides[n]) for n in VARIANTS}
        out[case] = {
            "rps": rps,
            "cpu_us": cpu,
            "rps_ratio": rps["after"] / rps["before"],
            "capacity_ratio": cpu["before"] / cpu["after"],
        }
    return out


def compare(args: argparse.Namespace) -> dict:
    """The whole comparison; the result as gateway_before.json holds it."""
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    after = args.after or "working tree at " + _git("describe", "--always", "--dirty")
    print(f"before = {args.before}, after = {after}, load {' '.join(loadavg)}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        result = run(args, Path(d))
    missing = {n: result["answered"][n] - result["usage_rows"][n] for n in VARIANTS}
    if any(m > 0 for m in missing.values()):
        raise RuntimeError(f"answered requests without a usage row: {missing}")
    return {
        "before": _git("rev-parse", "--short", args.before),
        "after": after,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "order": " ".join(ORDER),
        "summary": summarize(result["runs"]),
        **result,
        "loadavg_start": loadavg,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "wall_s": round(time.monotonic() - started),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    names = list(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 4.8))
    for offset, name, color in ((-0.2, "before", "#999999"), (0.2, "after", "#1f77b4")):
        xs = [i + offset for i in range(len(names))]
        label = f"{name} ({result[name]})"
        left.bar(xs, [summary[c]["rps"][name] for c in names], 0.4, color=color, label=label)
        for x, case in zip(xs, names, strict=True):
            runs = [r["rps"] for r in result["runs"][case][name]]
            left.plot([x] * len(runs), runs, "k.")
    labels = [c.replace("completions", "text").replace(" ", "\n") for c in names]
    left.set_xticks(range(len(names)), labels, fontsize=8)
    left.set_ylabel("requests/s (wrk; dots: runs)")
    left.legend(fontsize=8)
    left.set_title("requests/s, each gateway on one core")
    for offset, key, color in ((-0.2, "rps_ratio", "#1f77b4"), (0.2, "capacity_ratio", "#2ca02c")):
        xs = [i + offset for i in range(len(names))]
        label = "requests/s" if key == "rps_ratio" else "capacity (1 / CPU per request)"
        right.bar(xs, [summary[c][key] for c in names], 0.4, color=color, label=label)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.axhline(0.97, color="red", linestyle="--", linewidth=0.8, label="0.97 (3% lost)")
    right.set_xticks(range(len(names)), labels, fontsize=8)
    right.set_ylabel("after / before")
    right.legend(fontsize=8)
    right.set_title("after / before")
    load = " ".join(result["loadavg_start"])
    fig.suptitle(f"The gateway, {result['before']} against {result['after']} (load {load})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
