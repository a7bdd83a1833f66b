"""The dashboard fed by a recorded file: panels, sorting, filtering, pause, help, quit."""

from __future__ import annotations

from textual.widgets import Input
from top_helpers import DATA, SIZE, played_out, replay_app, wait_for

from tui import fmt
from tui.app import HelpScreen, TopApp
from tui.source import StatsSource, load_replay
from tui.view import quota_used
from tui.widgets import EnginePanel, LatencyPanel, StatusBar, TenantsTable


def screen_text(widget) -> str:
    """The characters a widget shows on screen, row by row."""
    return "\n".join(strip.text for strip in widget.render_lines(widget.region.reset_offset))


def tenant_names(app) -> list[str]:
    table = app.query_one(TenantsTable)
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


async def test_panels_show_the_numbers_in_the_file():
    last = load_replay(DATA)[-1]
    app = replay_app()
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)

        status = screen_text(app.query_one(StatusBar))
        assert fmt.duration(last["gateway"]["uptime_s"]) in status
        assert f"in flight {last['totals']['in_flight']}" in status
        assert "gemma-3-270m" in status and "replay finished" in status

        latency = screen_text(app.query_one(LatencyPanel))
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert fmt.ms(last["latency"][key]) in latency

        engine = screen_text(app.query_one(EnginePanel))
        running = sum(b["running"] for b in last["backends"])
        hits = sum(b["prefix_hits"] for b in last["backends"])
        queries = sum(b["prefix_queries"] for b in last["backends"])
        assert f"running {running}" in " ".join(engine.split())
        assert fmt.pct(hits / queries) in engine

        chart = app.query_one("#chart-output")
        assert chart.border_title == f"output {fmt.si(last['rates']['output_tokens_per_s'])} tok/s"

        table = app.query_one(TenantsTable)
        by_tokens = sorted(last["tenants"], key=lambda t: -t["tokens_per_s"])
        assert tenant_names(app) == [t["name"] for t in by_tokens]
        top = by_tokens[0]
        row = [str(cell) for cell in table.get_row_at(0)]
        assert row[2] == fmt.si(top["tokens_per_s"])
        assert row[5] == fmt.pct(quota_used(top["quota"]))
        assert top["name"] == "acme" and row[7] == "$3.26"  # spend today, in dollars
        # globex's money budget is its tightest limit: $1.89 of $2.50 today.
        globex = table.get_row(next(t["id"] for t in last["tenants"] if t["name"] == "globex"))
        assert (str(globex[5]), str(globex[7])) == ("75%", "$1.89")

        backends = app.query_one("#backends")
        assert backends.row_count == len(last["backends"])
        errors = app.query_one("#errors")
        assert errors.row_count == len(last["errors"])
        # Newest first.
        assert str(errors.get_row_at(0)[4]) == last["errors"][-1]["message"]


async def test_s_cycles_the_tenant_sort():
    last = load_replay(DATA)[-1]
    app = replay_app()
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("s")
        assert app.dashboard.sort_key == "requests_per_s"
        assert tenant_names(app) == [
            t["name"] for t in sorted(last["tenants"], key=lambda t: -t["requests_per_s"])
        ]
        await pilot.press("s", "s")
        assert app.dashboard.sort_key == "quota_used"
        await pilot.press("s")
        assert app.dashboard.sort_key == "spend_today"
        assert tenant_names(app) == [
            t["name"]
            for t in sorted(last["tenants"], key=lambda t: -t["quota"]["daily_spend_used"])
        ]
        await pilot.press("s")
        assert app.dashboard.sort_key == "name"
        assert tenant_names(app) == sorted(t["name"] for t in last["tenants"])
        await pilot.press("s")
        assert app.dashboard.sort_key == "tokens_per_s"


async def test_slash_filters_tenants_and_escape_clears():
    app = replay_app()
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("slash", "i", "n")
        assert tenant_names(app) == ["initech"]
        assert "1/6 matching 'in'" in app.query_one(TenantsTable).border_title
        await pilot.press("enter")  # keeps the filter, hides the box
        assert not app.query_one("#filter").display
        assert tenant_names(app) == ["initech"]

        await pilot.press("slash", "z", "z")
        assert tenant_names(app) == []
        await pilot.press("escape")
        assert app.dashboard.tenant_filter == "" and len(tenant_names(app)) == 6


async def test_escape_clears_a_filter_kept_with_enter():
    app = replay_app()
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("slash", "i", "n", "enter")
        assert tenant_names(app) == ["initech"] and app.query_one(TenantsTable).has_focus
        await pilot.press("escape")
        assert app.dashboard.tenant_filter == "" and len(tenant_names(app)) == 6
        assert app.query_one("#filter", Input).value == ""
        assert "matching" not in app.query_one(TenantsTable).border_title
        await pilot.press("slash")  # the box opens empty
        assert app.query_one("#filter", Input).value == ""


async def test_replay_header_sets_the_title_apart_from_the_replay_mark():
    app = replay_app()
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        status = app.query_one(StatusBar)
        header = status.render_lines(status.region.reset_offset)[0]
        assert header.text.split("│")[:2] == [" kvgate top ", f"  REPLAY  {DATA.name} "]
        segments = {seg.text: seg.style for seg in header}
        assert segments["kvgate top"].bold and not segments["kvgate top"].reverse
        assert segments[" REPLAY "].reverse  # a badge of its own


async def test_capital_s_saves_an_svg_screenshot(tmp_path):
    app = TopApp(
        StatsSource(replay=load_replay(DATA), replay_name=DATA.name, speed=0),
        screenshot_dir=tmp_path / "shots",
    )
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("S")
        await pilot.press("S")  # a second in the same second gets a name of its own
        await pilot.pause()
        saved = sorted((tmp_path / "shots").glob("kvgate-top-*.svg"))
        assert len(saved) == 2
        svg = saved[0].read_text()
        assert svg.startswith("<svg") and "REPLAY" in svg and "initech" in svg
        assert app.dashboard.sort_key == "tokens_per_s"  # S is not s


async def test_p_pauses_the_replay_and_resumes_it():
    app = replay_app(speed=10.0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.source.received >= 2)
        await pilot.press("p")
        assert "PAUSED" in screen_text(app.query_one(StatusBar))
        held = app.source.received
        await pilot.pause(0.3)
        assert app.source.received == held
        await pilot.press("p")
        await wait_for(pilot, lambda: app.source.received > held)
        assert "PAUSED" not in screen_text(app.query_one(StatusBar))


async def test_question_mark_opens_help_and_q_quits():
    app = replay_app()
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0


def test_served_is_each_tenants_share_of_the_fair_share_service():
    from tui.view import tenant_rows

    rows = tenant_rows(
        [
            {"id": "a", "name": "a", "fair_share": {"service": 300.0, "waiting": 2, "running": 1}},
            {"id": "b", "name": "b", "fair_share": {"service": 100.0, "waiting": 0, "running": 1}},
            {"id": "c", "name": "c", "fair_share": None},
        ]
    )
    assert [r.served for r in rows] == [0.75, 0.25, 0.0]
    assert tenant_rows([{"id": "x", "name": "x"}])[0].served is None  # no fair engine


def with_tiers(snapshots: list[dict]) -> list[dict]:
    """The recorded snapshots, with every backend reporting a host tier and the first a
    disk tier as well (as a gateway's admin stats do, `kv_tiers`)."""
    for snap in snapshots:
        for i, b in enumerate(snap["backends"]):
            b["kv_tiers"] = {"host": {"hits": 1500, "blocks": 40, "bytes": 40 << 16}}
            if i == 0:
                b["kv_tiers"]["disk"] = {"hits": 64, "blocks": 900, "rejected": 2}
    return snapshots


async def test_the_engine_panel_lists_the_kv_tiers_that_are_on():
    snapshots = with_tiers(load_replay(DATA))
    n = len(snapshots[-1]["backends"])
    app = TopApp(StatsSource(replay=snapshots, replay_name="tiers.jsonl", speed=0.0))
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        panel = app.query_one(EnginePanel)
        lines = [" ".join(row.strip("│ ").split()) for row in screen_text(panel).splitlines()]
        assert "KV tier hits blocks bytes" in lines
        host = f"host {fmt.si(1500 * n)} {fmt.si(40 * n)} {fmt.si((40 << 16) * n)}B"
        assert host in lines and f"disk {fmt.si(64)} {fmt.si(900)} 0.0B" in lines
        assert not any(line.startswith("shared") for line in lines)
        assert lines.index(host) > lines.index("KV tier hits blocks bytes")
        assert app.query_one("#middle").size.height == 7 + 3  # a header and two tiers
    app = replay_app()  # no tier on anywhere: the panel as it always was
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        assert "KV tier" not in screen_text(app.query_one(EnginePanel))
        assert app.query_one("#middle").size.height == 7


def test_tier_rows_sum_the_backends_and_skip_what_is_not_a_tier():
    from tui.view import TierRow, tier_rows

    backends = [
        {"kv_tiers": {"disk": {"hits": 5, "blocks": 2}, "tape": {"hits": 9}, "host": "x"}},
        {"kv_tiers": {"host": {"hits": 1, "bytes": 7}, "disk": {"hits": "lots"}}},
        {"kv_tiers": None},
        {},
    ]
    assert tier_rows(backends) == [TierRow("host", 1, 0, 7), TierRow("disk", 5, 2, 0)]
    assert tier_rows([{"name": "fake"}]) == []


async def test_the_engine_panel_shows_the_pulls_of_prefill_workers_blocks():
    snapshots = load_replay(DATA)
    for snap in snapshots:
        for b in snap["backends"]:
            b["kv_transfer"] = {"pulls": 3, "bytes": 3 << 20, "seconds": 0.25, "fallbacks": 1}
    n = len(snapshots[-1]["backends"])
    app = TopApp(StatsSource(replay=snapshots, replay_name="pulls.jsonl", speed=0.0))
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        panel = app.query_one(EnginePanel)
        lines = [" ".join(row.strip("│ ").split()) for row in screen_text(panel).splitlines()]
        assert f"block pulls {fmt.si(3 * n)} ({n} failed)" in lines
        assert f"pulled {fmt.si((3 << 20) * n)}B in {0.25 * n:.1f} s" in lines
        assert app.query_one("#middle").size.height == 7 + 2


def test_transfers_sum_the_backends_that_pull():
    from tui.view import Transfers, transfers

    backends = [
        {"kv_transfer": {"pulls": 2, "bytes": 10, "seconds": 0.5, "fallbacks": 1}},
        {"kv_transfer": {"pulls": 1, "bytes": "x"}},
        {"kv_transfer": {}},
        {},
    ]
    assert transfers(backends) == Transfers(3, 10, 0.5, 1)
    assert transfers([{"name": "fake"}, {"kv_transfer": {}}]) is None


def with_batches(snapshots: list[dict]) -> list[dict]:
    """The recorded snapshots with the gateway's batch list: one running, one done."""
    tenant = snapshots[-1]["tenants"][0]
    running = {
        "id": "batch_run", "tenant_id": tenant["id"], "tenant": tenant["name"],
        "status": "in_progress", "endpoint": "/v1/chat/completions",
        "request_counts": {"total": 40, "completed": 10, "failed": 10},
        "output_file_id": None, "error_file_id": None, "spend": 0.0123,
    }  # fmt: skip
    done = running | {
        "id": "batch_done", "status": "completed", "tenant": None,
        "request_counts": {"total": 3, "completed": 3, "failed": 0},
        "output_file_id": "file-out", "spend": 2.5,
    }  # fmt: skip
    for snap in snapshots:
        snap["batches"] = [running, done]
    return snapshots


async def test_the_batch_panel_shows_each_batchs_progress_files_and_spend():
    from tui.widgets import BatchesTable

    snapshots = with_batches(load_replay(DATA))
    app = TopApp(StatsSource(replay=snapshots, replay_name="batches.jsonl", speed=0.0))
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        table = app.query_one(BatchesTable)
        assert table.display and table.border_title == "batches (1 running, 2 shown)"
        run, done = ([str(c) for c in table.get_row(k)] for k in ("batch_run", "batch_done"))
        name = snapshots[-1]["tenants"][0]["name"]
        # a quarter done, a quarter failed: 3 green, 3 red and 6 dim cells of 12, 50% answered
        assert run[:3] == ["batch_run", name, "in_progress"]
        assert run[3] == "███" + "███" + "░" * 6 + " 50%"
        assert run[4:] == ["10/10/40", "$0.01", "- / -"]
        # a deleted tenant's batch: its id; a finished batch names its output file
        assert done[1] == snapshots[-1]["tenants"][0]["id"] and done[3].endswith(" 100%")
        assert done[5:] == ["$2.50", "file-out / -"]
        text = screen_text(table)
        assert "batch_run" in text and "50%" in text
        # the tenants' filter picks their batches: none of another tenant's
        other = snapshots[-1]["tenants"][1]["name"]
        await pilot.press("slash", *other, "enter")
        await pilot.pause()
        assert other.lower() not in name.lower() and not table.display
        await pilot.press("escape")
        await pilot.pause()
        assert table.display and table.row_count == 2
    app = replay_app()  # a gateway that reports no batch: no panel
    async with app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        assert not app.query_one(BatchesTable).display


def test_a_failure_shows_in_the_bar_however_few_and_bad_fields_read_as_nothing():
    from tui.view import batch_rows
    from tui.widgets import progress_bar

    (row,) = batch_rows([{"id": "b", "request_counts": {"total": 1000, "completed": 999,
                                                        "failed": 1}}])  # fmt: skip
    bar = progress_bar(row, 10)
    assert str(bar) == "█" * 10 + " 100%" and bar.spans[1].style == "red"
    (odd,) = batch_rows([{"request_counts": "all", "spend": "lots", "output_file_id": 7}])
    assert (odd.id, odd.total, odd.spend, odd.output_file_id, odd.done) == ("?", 0, 0.0, None, None)
    assert str(progress_bar(odd)) == "-"
