"""The before/after table of `python -m studies.hostile_surfaces`: one row a case, each
side's verdict and the figure it saw, as text for the terminal and as Markdown for
docs/PERF.md."""

from __future__ import annotations

VERDICT = {True: "pass", False: "FAIL", None: "n/a"}


def rows(result: dict) -> list[tuple[int, str, dict[str, dict]]]:
    """(item, case, side -> outcome) in item order, then the order cases were run."""
    table: dict[tuple[int, str], dict[str, dict]] = {}
    for side in result["sides"]:
        for outcome in result["outcomes"][side]:
            table.setdefault((outcome["item"], outcome["case"]), {})[side] = outcome
    ordered = sorted(table, key=lambda k: k[0])  # stable: run order within an item
    return [(item, case, table[item, case]) for item, case in ordered]


def _cell(outcome: dict | None) -> str:
    if outcome is None:
        return "not run"
    return f"{VERDICT[outcome['ok']]}: {outcome['figure']}"


def print_table(result: dict) -> None:
    sides = result["sides"]
    commits = " / ".join(f"{s} = {result['commits'][s]}" for s in sides)
    print(f"{commits}; load average {' '.join(result['loadavg_start'])} at the start")
    for item, case, by_side in rows(result):
        print(f"\n{item:>2}  {case}")
        for side in sides:
            print(f"    {side:<6} {_cell(by_side.get(side))}")
    for side in sides:
        outcomes = result["outcomes"][side]
        passed = sum(1 for o in outcomes if o["ok"])
        print(f"{side}: {passed} of {len(outcomes)} cases pass")


def markdown(result: dict) -> str:
    """The table for docs/PERF.md: a column a side, `|` in figures escaped."""
    sides = result["sides"]
    head = " | ".join(f"{s} ({result['commits'][s]})" for s in sides)
    lines = [f"| # | case | {head} |", "|---|---|" + "---|" * len(sides)]
    for item, case, by_side in rows(result):
        cells = " | ".join(_cell(by_side.get(s)).replace("|", "\\|") for s in sides)
        lines.append(f"| {item} | {case} | {cells} |")
    return "\n".join(lines)
