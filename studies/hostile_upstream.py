"""What an untrusted upstream can cost a gateway, before and after a change:

    python -m studies.hostile_upstream [--before REV] [--out FILE] [--plot FILE]

A hostile OpenAI-compatible server (studies/hostile_upstream_server.py) sits behind a
`type = "remote"` entry of a real `kvgate serve` of this tree and, with --before, of an
earlier commit (checked out in a git worktree), one after the other in the same run.
For each case: what the client got, what its tenant was billed, whether the tenant's
one concurrency slot came back, the gateway's longest and median `GET /health`
latency while the case ran (a prober in its own process, studies/hostile_load.py), and
how far the gateway's resident memory rose above where it was (its peak, reset before
each case). It prints a table, writes JSON to --out and a bar chart to --plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.options import DefaultsHelpFormatter
from studies.harness import ADMIN_KEY, free_port, make_tenant, stop_process
from studies.hostile_load import Prober, window_stats
from studies.hostile_upstream_server import SECRET, HostileUpstream

MODEL = "remote-model"
CLIENT_TIMEOUT_S = 20.0  # a case the gateway does not end is given up after this
ENDLESS_CAP = 20_000  # chunks the client reads of an endless stream before it leaves


@dataclass
class Case:
    name: str
    mode: str
    max_tokens: int = 20
    stream: bool = False
    chat_tools: bool = False
    usage: dict[str, Any] = field(default_factory=dict)
    setup: Callable[[HostileUpstream], None] = lambda up: None
    read_at_most: int | None = None  # then the client leaves
    logprobs: int | None = None


def _slow(up: HostileUpstream) -> None:
    up.delay_s = 0.02


CASES = [
    Case("hang-up after 5 chunks", "ok", 200, stream=True, setup=_slow, read_at_most=5),
    Case("usage 10^15 tokens", "ok", usage={"completion_tokens": 10**15}),
    Case("usage -3 tokens", "ok", usage={"completion_tokens": -3}),
    Case("usage 2x10^18 tokens", "ok", usage={"completion_tokens": 2 * 10**18}),
    Case("cached -10^9", "ok", usage={"cached_tokens": -(10**9)}),
    Case("usage 1 for 1,000", "ok", 1000, usage={"completion_tokens": 1}),
    Case("line over 1 MiB", "long_line", stream=True),
    Case("endless stream", "endless", 50, stream=True, read_at_most=ENDLESS_CAP),
    Case("100x max_tokens", "overlong", 50),
    Case("20,000 logprobs a token", "logprobs_flood", 3, logprobs=1),
    Case("200 MB in one event", "no_blank", setup=lambda up: setattr(up, "big_bytes", 200 << 20)),
    Case("gzip bomb", "gzip", setup=lambda up: setattr(up, "bomb_bytes", 320 << 20)),
    Case(
        "16 MB tool-call arguments",
        "tool_flood",
        70_000,
        stream=True,
        chat_tools=True,
        setup=lambda up: setattr(up, "tool_bytes", 16 << 20),
    ),
    Case("307 to an internal host", "redirect"),
    Case("a comment every 0.2 s", "trickle"),
    Case("its words in an error", "error_event", stream=True),
]


class Gateway:
    """`kvgate serve` of the tree at `root`, over `upstream`, on a database of its own."""

    def __init__(self, root: Path, work: Path, upstream: HostileUpstream, new: bool) -> None:
        self.root, self.port = root, free_port()
        self.db = work / f"gw-{self.port}.db"
        options = {"url": upstream.url, "context_length": 1 << 20, "read_timeout_s": 5}
        if new:  # the limits this change added; the old tree refuses unknown options
            options |= {"first_token_timeout_s": 10, "request_timeout_s": 15}
        lines = ["[[backends]]", 'name = "up"', 'type = "remote"', f'model = "{MODEL}"']
        lines += ["[backends.options]", *(f"{k} = {json.dumps(v)}" for k, v in options.items())]
        lines += [f'[prices."{MODEL}"]', "input = 1", "output = 2"]
        config = work / f"gw-{self.port}.toml"
        config.write_text("\n".join(lines) + "\n")
        env = dict(os.environ, KVGATE_ADMIN_KEY=ADMIN_KEY, PYTHONUNBUFFERED="1")
        env["KVGATE_DATABASE_URL"] = f"sqlite+aiosqlite:///{self.db}"
        self.log = work / f"gw-{self.port}.log"
        cmd = [sys.executable, "-m", "gateway.cli", "--config", str(config), "serve"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port)],
            cwd=root,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while "listening on" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvgate serve did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc)

    def tenant(self) -> tuple[str, str]:
        return make_tenant(self.url, f"t-{uuid.uuid4().hex[:8]}", max_concurrent=1)

    def rss_mb(self) -> tuple[float, float]:
        """(resident now, peak since the last reset) in MB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kb = {
            k: int(v.split()[0])
            for k, v in (ln.split(":", 1) for ln in status.splitlines())
            if k in ("VmRSS", "VmHWM")
        }
        return kb["VmRSS"] / 1024, kb["VmHWM"] / 1024

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def row(self, tenant_id: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with sqlite3.connect(self.db) as db:
                db.row_factory = sqlite3.Row
                sql = "SELECT * FROM usage_records WHERE tenant_id = ? ORDER BY id LIMIT 1"
                found = db.execute(sql, (tenant_id,)).fetchone()
            if found is not None:
                return dict(found)
            time.sleep(0.1)
        return None


def call(gw: Gateway, key: str, case: Case) -> dict[str, Any]:
    """The client's view: status, tokens (chunks or words) received, the error's text."""
    headers = {"Authorization": f"Bearer {key}"}
    body: dict[str, Any] = {"model": MODEL, "max_tokens": case.max_tokens, "stream": case.stream}
    path = "/v1/completions"
    if case.chat_tools:
        path = "/v1/chat/completions"
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        body |= {"messages": [{"role": "user", "content": "call f"}], "tools": [tool]}
    else:
        body["prompt"] = "a b c"
    if case.logprobs is not None:
        body["logprobs"] = case.logprobs
    got: dict[str, Any] = {"status": None, "received": 0, "error": "", "top_logprobs": 0}
    try:
        with (
            httpx.Client(base_url=gw.url, timeout=CLIENT_TIMEOUT_S) as http,
            http.stream("POST", path, json=body, headers=headers) as resp,
        ):
            got["status"] = resp.status_code
            if not case.stream:
                _whole(json.loads(resp.read()), got)
                return got
            for line in resp.iter_lines():
                _event(line, got)
                if case.read_at_most and got["received"] >= case.read_at_most:
                    break
    except httpx.TimeoutException:
        got["error"] = f"no end within {CLIENT_TIMEOUT_S:g} s"
    except httpx.HTTPError as e:  # the old gateway could break its own response
        got["error"] = f"a broken response ({type(e).__name__})"
    return got


def _whole(data: dict[str, Any], got: dict[str, Any]) -> None:
    if "error" in data:
        got["error"] = data["error"].get("message", "")
        return
    choice = data["choices"][0]
    got["received"] = len(choice.get("text", "").split())
    lps = choice.get("logprobs") or {}
    got["top_logprobs"] = max((len(t) for t in lps.get("top_logprobs") or [] if t), default=0)


def _event(line: str, got: dict[str, Any]) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    obj = json.loads(line[6:])
    if "error" in obj:
        got["error"] = obj["error"].get("message", "")
    elif obj.get("choices"):
        got["received"] += 1


def run_case(gw: Gateway, up: HostileUpstream, case: Case) -> dict[str, Any]:
    up.mode, up.usage, up.delay_s = case.mode, case.usage, 0.0
    up.big_bytes, up.bomb_bytes, up.tool_bytes = 8 << 20, 64 << 20, 4 << 20
    case.setup(up)
    tenant_id, key = gw.tenant()
    hits = len(up.recorder.hits)
    gw.reset_peak()
    before, _ = gw.rss_mb()
    prober = Prober(gw.url, 0.01)
    start = time.monotonic()
    got = call(gw, key, case)
    seconds = time.monotonic() - start
    time.sleep(0.5)  # what the gateway does after the client is done counts too
    stats = window_stats(prober.stop(), start, time.monotonic())
    _, peak = gw.rss_mb()
    row = gw.row(tenant_id)
    up.mode, up.usage, up.delay_s = "ok", {}, 0.0
    follow = call(gw, key, Case("slot", "ok", 2))  # refused if the slot leaked
    return {
        "case": case.name,
        "client": got,
        "seconds": round(seconds, 2),
        "billed": None
        if row is None
        else {
            k: row[k]
            for k in (
                "status",
                "completion_tokens",
                "cached_tokens",
                "spend_nano_usd",
                "counted_by",
            )
        },
        "slot_back": follow["status"] == 200 and not follow["error"],
        "redirect_hits": len(up.recorder.hits) - hits,
        "secret_leaked": SECRET in got["error"],
        "health_p50_ms": stats["p50_ms"],
        "health_max_ms": stats["max_ms"],
        "rss_rise_mb": round(peak - before, 1),
    }


def run_tree(root: Path, new: bool, work: Path, cases: list[Case]) -> list[dict[str, Any]]:
    with HostileUpstream(MODEL) as up:
        gw = Gateway(root, work, up, new)
        try:
            results = []
            for case in cases:
                print(f"  {case.name} ...", flush=True)
                results.append(run_case(gw, up, case))
            return results
        finally:
            gw.stop()


def print_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    for label, results in runs.items():
        print(f"\n{label}")
        print(
            f"{'case':28} {'client':34} {'billed':18} {'slot':5} {'/health max':>11} {'RSS +MB':>8}"
        )
        for r in results:
            c, b = r["client"], r["billed"] or {}
            client = f"{c['status']} recv {c['received']}" + (
                f" top {c['top_logprobs']}" if c["top_logprobs"] else ""
            )
            if c["error"]:
                client += " err" + (" SECRET" if r["secret_leaked"] else "")
            billed = f"{b.get('status')} {b.get('completion_tokens')}" if b else "no row"
            print(
                f"{r['case']:28} {client:34} {billed:18} {'yes' if r['slot_back'] else 'NO':5} {r['health_max_ms'] or 0:>11.0f} {r['rss_rise_mb']:>8.1f}"
            )


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in next(iter(runs.values()))]
    fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharey=True)
    for ax, metric, title in zip(
        axes,
        ("health_max_ms", "rss_rise_mb"),
        ("longest /health wait (ms)", "resident memory rise (MB)"),
        strict=True,
    ):
        height = 0.8 / len(runs)
        for i, (label, results) in enumerate(runs.items()):
            ys = [k + i * height for k in range(len(names))]
            ax.barh(ys, [max(r[metric] or 0, 0.1) for r in results], height, label=label)
        ax.set_xscale("log")
        ax.set_title(title)
    axes[0].set_yticks([k + 0.4 - 0.4 / len(runs) for k in range(len(names))], names)
    axes[0].invert_yaxis()
    axes[1].legend()
    fig.suptitle("A hostile upstream behind a remote entry: the gateway's cost per case")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--before", help="also run this commit (a git revision) first")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a bar chart (PNG) here")
    parser.add_argument("--only", help="run only the cases whose names contain this text")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or args.only in c.name]
    here = Path(__file__).resolve().parent.parent
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-hostile-upstream-") as tmp:
        work = Path(tmp)
        if args.before:
            tree = work / "before"
            subprocess.run(
                ["git", "-C", str(here), "worktree", "add", "--detach", str(tree), args.before],
                check=True,
                capture_output=True,
            )
            try:
                print(f"before ({args.before}):")
                runs[f"before ({args.before})"] = run_tree(tree, False, work, cases)
            finally:
                subprocess.run(
                    ["git", "-C", str(here), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )
        print("this tree:")
        runs["this tree"] = run_tree(here, True, work, cases)
    print_table(runs)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
