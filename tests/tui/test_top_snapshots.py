"""Screenshots of the main screen from the recorded file, compared with the committed SVGs.

Deterministic by construction: fixed terminal size, replayed data, times in UTC taken
from the file, no clock on screen. Update with `pytest tests/tui --snapshot-update`.
"""

from __future__ import annotations

from top_helpers import SIZE, played_out, replay_app


def test_main_screen(snap_compare):
    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=played_out)


def test_sorted_by_quota_and_filtered(snap_compare):
    async def sort_and_filter(pilot):
        await played_out(pilot)
        await pilot.press("s", "s", "s", "slash", "o")

    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=sort_and_filter)


def test_help_screen(snap_compare):
    async def open_help(pilot):
        await played_out(pilot)
        await pilot.press("question_mark")

    assert snap_compare(replay_app(), terminal_size=SIZE, run_before=open_help)
