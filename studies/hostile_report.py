"""The table and the plot of `python -m studies.hostile`: what a reader looks at first."""

from __future__ import annotations

from pathlib import Path

from studies.hostile_load import GOAL_MS


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def bad_inputs_table(bad: dict) -> list[str]:
    kinds = ", ".join(f"{k} {n}" for k, n in bad["kinds"].items())
    lines = [
        f"Bad inputs: {bad['tried']} tried ({kinds})",
        f"{'kind':<24} {'case':<30} {'status':>6} {'body':<9} {'ok':<3} {'tb':>2}  note",
    ]
    for c in bad["cases"]:
        status = "-" if c["status"] is None else str(c["status"])
        lines.append(
            f"{c['kind']:<24} {c['name']:<30} {status:>6} {c['shape']:<9} "
            f"{'yes' if c['expected'] else 'NO':<3} {c['tracebacks']:>2}  {c['note']}"
        )
    lines.append(
        f"5xx: {bad['5xx']}   non-JSON error bodies: {bad['non_json_errors']}   "
        f"no answer: {bad['no_answer']}   not as expected: {bad['unexpected']}   "
        f"Tracebacks logged: {bad['log_tracebacks']}"
    )
    return lines


def stall_table(stall: dict) -> list[str]:
    lines = [
        f"Event-loop stall: GET /health every {stall['probe_interval_ms']:g} ms "
        f"(goal: longest under {GOAL_MS} ms)",
        f"{'window':<12} {'checks':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{f'>={GOAL_MS} ms':>8}  attackers got",
    ]
    for w in stall["windows"]:
        got = ", ".join(f"{k}: {v}" for k, v in w.get("attackers_got", {}).items())
        lines.append(
            f"{w['name']:<12} {w['samples']:>6} {_ms(w['p50_ms']):>8} "
            f"{_ms(w['p99_ms']):>8} {_ms(w['max_ms']):>8} {w['over_goal']:>8}  {got or '-'}"
        )
    f = stall["fanout"]
    lines.append(
        f"fan-out body: {f['prompts']} prompts x n={f['n']}, max_tokens {f['max_tokens']};"
        f" compression body: gzip of {stall['bomb_mib']} MiB of zeros, "
        f"{stall['bomb_bytes']:,} bytes; Tracebacks logged: {stall['tracebacks']}"
    )
    return lines


def kill9_table(k: dict) -> list[str]:
    return [
        f"kill -9 under load: {k['clients']} clients for {k['load_s']:g} s, then kill -9 "
        "and a restart on the same database",
        f"responses received whole: {k['completed']} ({k['completed_streams']} streams)   "
        f"cut off: {k['incomplete']}   usage rows: {k['rows']}",
        f"usage rows lost (goal 0): {k['lost_rows']}   "
        f"billed, not delivered: {k['billed_not_delivered']}   "
        f"errors before the kill: {k['errors_before_kill'] or 0}   "
        f"restarted: {'yes' if k['restarted'] else 'NO'}   Tracebacks: {k['tracebacks']}",
    ]


def print_table(result: dict) -> None:
    load = ", ".join(f"{x:.1f}" for x in result["machine"]["load_average_at_start"])
    print(
        f"database: {result['database']}; {result['machine']['cpus']} CPUs, load average "
        f"{load} at the start"
    )
    for name, table in (("bad", bad_inputs_table), ("stall", stall_table), ("kill9", kill9_table)):
        if name in result:
            print()
            print("\n".join(table(result[name])))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stall = result["stall"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs = [s[0] for s in stall["samples"]]
    ys = [max(s[1], 0.01) for s in stall["samples"]]
    ax.plot(xs, ys, ".", markersize=2, color="#1f77b4", label="GET /health latency")
    colors = {"fan-out": "#d62728", "compression": "#ff7f0e"}
    for w in stall["windows"]:
        if w["name"] not in colors:
            continue
        ax.axvspan(
            w["start"],
            w["end"],
            color=colors[w["name"]],
            alpha=0.25,
            label=f"{w['name']} attack (max {_ms(w['max_ms'])} ms)",
        )
        if w["settled"] is not None:
            ax.axvspan(w["end"], w["settled"], color=colors[w["name"]], alpha=0.08)
    ax.axhline(GOAL_MS, color="red", linestyle="--", label=f"goal: under {GOAL_MS} ms")
    ax.set_yscale("log")
    ax.set_xlabel("seconds (light shading: attackers gone, gateway recovering)")
    ax.set_ylabel("ms")
    ax.set_title(
        f"Event-loop stalls under attack ({result['database']}): "
        f"/health every {stall['probe_interval_ms']:g} ms on one keep-alive connection"
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
