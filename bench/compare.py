"""`kvgate bench history` and `kvgate bench compare A B`: the recorded runs, and what
changed between two of them.

A change is flagged when it is larger than the runs' own noise: the larger of the two
runs' spreads (max - min over their repeat rounds). A run of one round has no spread to
go by: its changes are shown with "?" rather than judged.

Only runs of one workload are compared: the same kind of run, server, model, prompts and
request shape (every config field but those that say how the run was kept, and the
engine settings a comparison is for). Runs that differ are refused, naming what differs,
unless `--allow-different` asks for them, and then the output says so first.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.history import find_record, load_records
from bench.redact import SECRET_FIELDS

# figures where more is better; every other figure (latencies, memory) less is
HIGHER_IS_BETTER = ("throughput", "tokens_per_s", "goodput", "completed")
SERVE_METRICS = ("ttft", "tpot", "itl", "e2el")


def serve_figures(result: dict) -> dict[str, float]:
    """The figures a `bench serve` result is judged by: throughputs, the latency
    summaries it computed (mean, median, percentiles), completed and failed."""
    names = ["output_throughput", "total_token_throughput", "request_throughput"]
    names += ["completed", "failed"]
    for metric in SERVE_METRICS:
        names += [k for k in result if k.endswith(f"_{metric}_ms") and not k.startswith("std_")]
    return {n: float(result[n]) for n in names if isinstance(result.get(n), int | float)}


@dataclass
class Change:
    figure: str
    before: float
    after: float
    spread: float | None  # None: a run of one round, no noise to judge by
    flagged: bool | None  # None: not judged

    @property
    def delta(self) -> float:
        return self.after - self.before

    @property
    def percent(self) -> float | None:
        return 100 * self.delta / self.before if self.before else None

    @property
    def better(self) -> bool:
        up = any(word in self.figure for word in HIGHER_IS_BETTER)
        return self.delta > 0 if up else self.delta < 0


# config fields that may differ between two runs of one workload: how the run was kept
# or judged, the keys (redacted), and the server's or engine's settings, which are what
# a comparison (a tune's candidates, a ladder's steps) is for
NOT_WORKLOAD = frozenset(
    {
        "command", "save_result", "save_detailed", "plot", "markdown", "results_dir",
        "no_history", "no_progress", "label", "label2", "rounds", "repeats", "server_pid",
        "percentile_metrics", "metric_percentiles", "goodput", "api_key_file",
        "api_key_file2", "output", "budget", "noise", "start_timeout", "steps",
        "candidate", "stage", "stopped", "goals", "backend", "device", "dtype",
        "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs",
        "max_num_batched_tokens", "kv_cache_dtype", "quantization", "speculative_config",
        "enable_prefix_caching",
    }
    | SECRET_FIELDS
)  # fmt: skip
UNRECORDED = object()  # a field one record lacks (an older kvgate's)


@dataclass
class Difference:
    field: str
    a: object
    b: object

    def __str__(self) -> str:
        return f"{self.field}: {_shown(self.a)} in A, {_shown(self.b)} in B"

    def as_json(self) -> dict:
        """field, a and b; a side that did not record the field left out."""
        sides = {"a": self.a, "b": self.b}
        return {"field": self.field} | {k: v for k, v in sides.items() if v is not UNRECORDED}


def _shown(value: object) -> str:
    return "not recorded" if value is UNRECORDED else json.dumps(value)


def workload_differences(a: dict, b: dict) -> list[Difference]:
    """What makes the two runs different workloads: their kind, then each config field
    outside NOT_WORKLOAD whose value differs (or that only one of them recorded)."""
    found = []
    if a.get("kind") != b.get("kind"):
        found.append(Difference("kind of run", a.get("kind"), b.get("kind")))
    config_a, config_b = a.get("config") or {}, b.get("config") or {}
    for name in dict.fromkeys([*config_a, *config_b]):
        value_a, value_b = config_a.get(name, UNRECORDED), config_b.get(name, UNRECORDED)
        if name not in NOT_WORKLOAD and value_a != value_b:
            found.append(Difference(name, value_a, value_b))
    return found


def compare_records(a: dict, b: dict) -> list[Change]:
    """Each figure both runs have, before (a) and after (b), flagged when the change
    exceeds the larger spread of the two runs' rounds."""
    changes = []
    for name, before in a["figures"].items():
        after = b["figures"].get(name)
        if after is None:
            continue
        spreads = [r.get("spread", {}).get(name) for r in (a, b)]
        judged = all(len(r.get("rounds", [])) > 1 for r in (a, b)) and None not in spreads
        spread = max(spreads) if judged else None
        flagged = abs(after - before) > spread if judged else None
        changes.append(Change(name, before, after, spread, flagged))
    return changes


def format_changes(a: dict, b: dict, changes: list[Change]) -> str:
    lines = [
        f"A {a['id']} ({a.get('when')}, {_code(a)}, {len(a.get('rounds', []))} rounds)",
        f"B {b['id']} ({b.get('when')}, {_code(b)}, {len(b.get('rounds', []))} rounds)",
        "",
        f"{'figure':<28} {'A':>12} {'B':>12} {'change':>10} {'spread':>10}  flag",
    ]
    for c in changes:
        pct = f"{c.percent:+.1f}%" if c.percent is not None else "n/a"
        spread = f"{c.spread:.3g}" if c.spread is not None else "-"
        if c.flagged is None:
            flag = "?"
        elif c.flagged:
            flag = "BETTER" if c.better else "WORSE"
        else:
            flag = ""
        lines.append(
            f"{c.figure:<28} {c.before:>12.4g} {c.after:>12.4g} {pct:>10} {spread:>10}  {flag}"
        )
    if any(c.flagged is None for c in changes):
        lines.append("\n?: a run of one round has no spread to judge a change by (--rounds N)")
    return "\n".join(lines)


def _code(record: dict) -> str:
    version = record.get("version") or {}
    commit = version.get("commit")
    if commit:
        return commit + ("+changes" if version.get("dirty") else "")
    return f"kvgate {version.get('package')}"


def cmd_history(args: argparse.Namespace) -> int:
    records = load_records(args.results_dir)
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    if not records:
        print(f"no runs recorded in {args.results_dir or 'the default results directory'}")
        return 0
    print(f"{'#':>3} {'id':<34} {'code':<18} {'out tok/s':>10} {'p99 TTFT ms':>12}  command")
    for i, r in enumerate(records):
        figures = r["figures"]
        tput = figures.get("output_throughput")
        ttft = figures.get("p99_ttft_ms")
        print(
            f"{i - len(records):>3} {r['id']:<34} {_code(r):<18} "
            f"{_num(tput):>10} {_num(ttft):>12}  {' '.join(r.get('command', []))[:60]}"
        )
    return 0


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cmd_compare(args: argparse.Namespace) -> int:
    a, b = find_record(args.a, args.results_dir), find_record(args.b, args.results_dir)
    differences = workload_differences(a, b)
    listed = "".join(f"\n  {d}" for d in differences)
    if differences and not args.allow_different:
        raise ValueError(
            f"A ({a['id']}) and B ({b['id']}) are runs of different workloads:{listed}\n"
            "their figures would not show what one change did; --allow-different compares "
            "them anyway"
        )
    warning = ""
    if differences:
        warning = "WARNING: A and B are runs of different workloads, so a change below may be "
        warning += f"that difference rather than yours:{listed}\n"
    changes = compare_records(a, b)
    if args.json:
        print(warning, end="", file=sys.stderr)
        rows = [asdict(c) | {"delta": c.delta, "percent": c.percent} for c in changes]
        unlike = [d.as_json() for d in differences]
        body = {"a": a["id"], "b": b["id"], "different_workloads": unlike, "changes": rows}
        print(json.dumps(body, indent=2))
    else:
        print(warning + format_changes(a, b, changes))
    return 0


def add_history_commands(sub: argparse._SubParsersAction, fmt: type) -> None:
    history = sub.add_parser("history", formatter_class=fmt, help="the recorded benchmark runs")
    add_results_dir_arg(history)
    history.add_argument("--json", action="store_true", help="the records as JSON")
    history.set_defaults(run=cmd_history)
    compare = sub.add_parser(
        "compare", formatter_class=fmt, help="what changed between two recorded runs"
    )
    compare.add_argument("a", help="a run: its id (or a unique prefix), -1 (the latest), a file")
    compare.add_argument("b", help="the other run, the same ways")
    add_results_dir_arg(compare)
    compare.add_argument("--json", action="store_true")
    compare.add_argument(
        "--allow-different",
        action="store_true",
        help="compare runs of different workloads (server, model, prompts, request shape), "
        "with a warning that names what differs",
    )
    compare.set_defaults(run=cmd_compare)


def add_results_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--results-dir",
        type=Path,
        metavar="DIR",
        help="where run records are kept (default: $KVGATE_BENCH_HISTORY, else "
        "~/.cache/kvgate/bench-history)",
    )
