"""studies/hostile_surfaces.py: what it counts as a leak of internals, its before/after
table, and its cases against this tree's real `kvgate serve` processes, where each of
issue 45's items it tries must pass: the fake gateway's, and in the slow test the gpu
engines' adapters and KV tiers (the hang-ups and the silent model's bench, which take
minutes there, have tests of their own: test_hangup_prefill, test_silent_replies)."""

import json

import pytest

from studies.hostile_surfaces import main
from studies.hostile_surfaces_admin import INTERNALS
from studies.hostile_surfaces_report import markdown

# e74401a's answer to an embedding input of [[1, "a"]], and today's
PYDANTIC = (
    "input.constrained-str: Input should be a valid string; input.list[constrained-str].0: "
    "Input should be a valid string; input.function-after[functools.partial(<function "
    "check_ids at 0x7f3a2b1c4d60>)]: Input should be a valid integer"
)
PLAIN = "input[0][1]: must be an integer"


def test_internals_are_told_from_the_apis_words():
    assert INTERNALS.search(PYDANTIC)
    for leak in ("list[constrained-str]", "functools.partial(", "at 0x7f3a2b1c4d60"):
        assert INTERNALS.search(leak), leak
    assert INTERNALS.search(PLAIN) is None
    assert INTERNALS.search("input[0][0]: must be at most 2147483647") is None


def test_the_table_has_a_column_a_side_and_a_row_a_case():
    outcome = {"item": 9, "case": "/tokenize after a 429", "figure": "tokenize 200 | 200"}
    result = {
        "sides": ["before", "after"],
        "commits": {"before": "e74401a", "after": "abc1234"},
        "outcomes": {
            "before": [outcome | {"ok": False}],
            "after": [
                outcome | {"ok": True, "figure": "tokenize 429"},
                {"item": 1, "case": "hang-up", "ok": None, "figure": "-"},
            ],
        },
    }
    assert markdown(result).splitlines() == [
        "| # | case | before (e74401a) | after (abc1234) |",
        "|---|---|---|---|",
        "| 1 | hang-up | not run | n/a: - |",
        "| 9 | /tokenize after a 429 | FAIL: tokenize 200 \\| 200 | pass: tokenize 429 |",
    ]


def run_items(tmp_path, items: str) -> list[dict]:
    out, table = tmp_path / "result.json", tmp_path / "table.md"
    argv = ["--items", items, "--workdir", str(tmp_path / "work"), "--out", str(out)]
    argv += ["--models", str(tmp_path / "models"), "--markdown", str(table)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["sides"] == ["after"] and "working tree" in result["commits"]["after"]
    assert table.read_text().startswith("| # | case | after (working tree")
    return result["outcomes"]["after"]


def test_the_fake_gateways_cases_pass_on_this_tree(tmp_path):
    outcomes = run_items(tmp_path, "2,6,8,9,10,12")
    assert {o["item"] for o in outcomes} == {2, 6, 8, 9, 10, 12}
    assert len(outcomes) == 11  # 3 reloads and 4 bad inputs among them
    failed = [o for o in outcomes if o["ok"] is not True]
    assert not failed, failed


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_engines_cases_pass_on_this_tree(tmp_path):
    outcomes = run_items(tmp_path, "3,4,5,7")
    assert {o["item"] for o in outcomes} == {3, 4, 5, 7}
    failed = [o for o in outcomes if o["ok"] is not True]
    assert not failed, failed
