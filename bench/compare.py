"""`kvgate bench history` and `kvgate bench compare A B`: the recorded runs, and what
changed between two of them.

A change is flagged when it is larger than the runs' own noise: the larger of the two
runs' spreads (max - min over their repeat rounds). A run of one round has no spread to
go by: its changes are shown with "?" rather than judged.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.history import find_record, load_records

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
    changes = compare_records(a, b)
    if args.json:
        rows = [asdict(c) | {"delta": c.delta, "percent": c.percent} for c in changes]
        print(json.dumps({"a": a["id"], "b": b["id"], "changes": rows}, indent=2))
    else:
        print(format_changes(a, b, changes))
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
    compare.set_defaults(run=cmd_compare)


def add_results_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--results-dir",
        type=Path,
        metavar="DIR",
        help="where run records are kept (default: $KVGATE_BENCH_HISTORY, else "
        "~/.cache/kvgate/bench-history)",
    )
