"""What `kvgate tune` leaves in its output directory: the chosen config (kvgate.toml,
for `kvgate serve --config`), every candidate as a table (report.md) and as JSON
(tune.json), and a plot of throughput against p99 TTFT with the goals drawn (tune.png).

When no candidate meets the goals (a CPU against a GPU's goals), the closest one's config
is written all the same, so that the next command, `kvgate serve --config`, works: its
first lines, and what tune prints, say which goals it misses and by how much."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from bench.history import code_version
from bench.tune_server import config_toml

if TYPE_CHECKING:
    from bench.tune_run import Measured, Tuner


def candidate_rows(tuner: Tuner, best: Measured | None) -> list[dict]:
    rows = []
    for m in tuner.measured:
        peak = next((k for k in (m.rounds[-1] if m.rounds else {}) if k.startswith("peak_")), None)
        rows.append(
            {
                "candidate": m.candidate.name,
                "stage": m.stage,
                "settings": m.candidate.engine_options(),
                "rounds": len(m.rounds),
                "output_throughput": m.median("output_throughput"),
                "p99_ttft_s": m.median("p99_ttft_ms") / 1000,
                "p99_tpot_s": m.median("p99_tpot_ms") / 1000,
                "peak_memory_mib": m.median(peak) / (1 << 20) if peak else None,
                "meets_goals": m.meets(tuner.goals),
                "chosen": m is best,
                "note": m.error or m.note,
            }
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| candidate | stage | rounds | output tok/s | p99 TTFT (s) | p99 TPOT (s) "
        "| peak memory (MiB) | goals | note |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        name = r["candidate"]
        if r["chosen"]:
            name = f"**{name}** ({'chosen' if r['meets_goals'] else 'closest, written'})"
        peak = f"{r['peak_memory_mib']:.0f}" if r["peak_memory_mib"] else "-"
        lines.append(
            f"| {name} | {r['stage']} | {r['rounds']} | {_f(r['output_throughput'], 1)} "
            f"| {_f(r['p99_ttft_s'], 3)} | {_f(r['p99_tpot_s'], 4)} | {peak} "
            f"| {'met' if r['meets_goals'] else 'missed'} | {r['note']} |"
        )
    return "\n".join(lines)


def _f(value: float, digits: int) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def plot(rows: list[dict], tuner: Tuner, path: str) -> None:
    """Output tokens/s against p99 TTFT, one point per candidate; the TTFT goal a line,
    the candidates missing the TPOT goal crossed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    goals = tuner.goals
    shown = [r for r in rows if not math.isnan(r["output_throughput"])]
    for r in shown:
        tpot_ok = r["p99_tpot_s"] <= goals.tpot_p99_s
        marker = "*" if r["chosen"] else ("o" if tpot_ok else "x")
        color = "green" if r["meets_goals"] else "red"
        ax.plot(
            r["p99_ttft_s"],
            r["output_throughput"],
            marker,
            color=color,
            ms=12 if r["chosen"] else 7,
        )
        if r["chosen"] or r["stage"] == "defaults":
            chosen = "chosen" if r["meets_goals"] else "closest"
            ax.annotate(
                chosen if r["chosen"] else "defaults",
                (r["p99_ttft_s"], r["output_throughput"]),
                textcoords="offset points",
                xytext=(6, 6),
            )
    ax.axvline(goals.ttft_p99_s, color="gray", ls="--", label=f"TTFT goal {goals.ttft_p99_s} s")
    ax.plot([], [], "x", color="red", label=f"over the TPOT goal ({goals.tpot_p99_s} s)")
    ax.plot([], [], "o", color="green", label="meets both goals")
    ax.set_xlabel("p99 TTFT (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"kvgate tune: {len(shown)} candidates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def missed(tuner: Tuner, m: Measured) -> list[str]:
    """How `m` misses the goals; a candidate stopped early says so."""
    return tuner.goals.misses(m.figures()) + ([m.error] if m.error else [])


def toml_header(tuner: Tuner, chosen: Measured) -> str:
    """The chosen config's first lines: what it was chosen for, or what it misses."""
    goals = tuner.goals
    when = datetime.now(UTC).isoformat(timespec="seconds")
    wanted = f"p99 TTFT <= {goals.ttft_p99_s} s and p99 TPOT <= {goals.tpot_p99_s} s"
    measured = f"{chosen.median('output_throughput'):.1f} tok/s on the workload of tune.json"
    if chosen.meets(goals):
        return f"kvgate tune, {when}: the most output tokens/s meeting {wanted}\n({measured})"
    return "\n".join(
        [
            f"kvgate tune, {when}: NO candidate met {wanted}.",
            f"This is the closest ({chosen.candidate.name}, {measured}); it misses:",
            *(f"  {miss}" for miss in missed(tuner, chosen)),
        ]
    )


def write_report(tuner: Tuner, best: Measured | None) -> None:
    """The files; `best` is the config written: the chosen one, or the closest."""
    out, args = tuner.out, tuner.args
    rows = candidate_rows(tuner, best)
    table = markdown_table(rows)
    summary = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "version": code_version(),
        "command": tuner.command,
        "model": args.model,
        "engine": tuner.base,
        "workload": tuner.workload,
        "goals": {"ttft_p99_s": tuner.goals.ttft_p99_s, "tpot_p99_s": tuner.goals.tpot_p99_s},
        "budget_s": tuner.budget_s,
        "chosen": best.candidate.name if best else None,
        "chosen_misses": missed(tuner, best) if best and not best.meets(tuner.goals) else [],
        "candidates": rows,
    }
    (out / "tune.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(table + "\n")
    plot(rows, tuner, str(out / "tune.png"))
    print("\n" + table)
    if best is None:  # nothing measured: no config, not even an older run's
        (out / "kvgate.toml").unlink(missing_ok=True)
    else:
        (out / "kvgate.toml").write_text(
            config_toml(args.model, tuner.base, best.candidate, toml_header(tuner, best))
        )
        if best.meets(tuner.goals):
            print(f"\nchosen: {best.candidate.name}; wrote {out / 'kvgate.toml'}")
        else:
            misses = "".join(f"\n  {miss}" for miss in missed(tuner, best))
            print(
                f"\nno candidate met the goals; wrote the closest, {best.candidate.name}, to "
                f"{out / 'kvgate.toml'}. It misses:{misses}"
            )
    print(f"wrote {out / 'report.md'}, {out / 'tune.json'} and {out / 'tune.png'}")
