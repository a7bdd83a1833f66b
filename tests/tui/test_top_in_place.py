"""The tables are updated in place: a refresh keeps the cursor on its tenant (by key),
keeps the scroll, rewrites changed cells, and drops the rows that went away.

Snapshots go in through `StatsSource.ingest`, the path a live gateway's stream takes.
"""

from __future__ import annotations

from top_helpers import SIZE, played_out

from tui import fmt
from tui.app import TopApp
from tui.source import StatsSource
from tui.widgets import BackendsTable, ErrorsTable, TenantsTable


def tenant(i: int, tokens_per_s: float, **fields) -> dict:
    return {
        "id": f"t{i:02d}",
        "name": f"tenant-{i:02d}",
        "requests_per_s": 1.0,
        "tokens_per_s": tokens_per_s,
        "rejected_429": 0,
        "in_flight": 0,
        "quota": {},
    } | fields


def tenants(n: int) -> list[dict]:
    """`n` tenants, busiest first in id order: t00 is at the top when sorted by tok/s."""
    return [tenant(i, 1000.0 - i) for i in range(n)]


def snapshot(tenant_list: list[dict], backends=(), errors=()) -> dict:
    return {"tenants": tenant_list, "backends": list(backends), "errors": list(errors)}


class Feed:
    """Hands the running app one snapshot at a time and waits until it is drawn."""

    def __init__(self, first: dict) -> None:
        self.app = TopApp(StatsSource(replay=[first | {"ts": 0.0}], replay_name="test"))
        self.ts = 0.0

    async def send(self, pilot, snap: dict) -> None:
        self.ts += 1.0
        self.app.source.ingest(snap | {"ts": self.ts})
        await pilot.pause()
        await pilot.pause()  # and let the table settle its column widths


def table(app) -> TenantsTable:
    return app.query_one(TenantsTable)


def cursor_key(app) -> str:
    t = table(app)
    return t.coordinate_to_cell_key(t.cursor_coordinate).row_key.value


def row_keys(t) -> list[str]:
    return [row.key.value for row in t.ordered_rows]


async def test_cursor_stays_on_its_tenant_when_rows_change_around_it():
    feed = Feed(snapshot(tenants(10)))
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("down", "down", "down")
        assert cursor_key(feed.app) == "t03"

        # Same tenants, other numbers, same order.
        await feed.send(pilot, snapshot([t | {"in_flight": 4} for t in tenants(10)]))
        assert cursor_key(feed.app) == "t03" and table(feed.app).cursor_row == 3

        # A new tenant sorts in above it: the cursor follows t03 down one row.
        await feed.send(pilot, snapshot([tenant(50, 5000.0), *tenants(10)]))
        assert row_keys(table(feed.app))[0] == "t50"
        assert cursor_key(feed.app) == "t03" and table(feed.app).cursor_row == 4

        # t03 itself gets busy and moves to the top.
        rows = [tenant(50, 5000.0), *tenants(10)]
        rows[4] = tenant(3, 9000.0)
        await feed.send(pilot, snapshot(rows))
        assert row_keys(table(feed.app))[:2] == ["t03", "t50"]
        assert cursor_key(feed.app) == "t03" and table(feed.app).cursor_row == 0

        # Rows above it go away.
        await feed.send(pilot, snapshot([tenant(3, 10.0), *tenants(10)[6:]]))
        assert row_keys(table(feed.app)) == ["t06", "t07", "t08", "t09", "t03"]
        assert cursor_key(feed.app) == "t03" and table(feed.app).cursor_row == 4


async def test_scroll_offset_is_kept_across_refreshes():
    feed = Feed(snapshot(tenants(60)))
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press(*["down"] * 30)
        t = table(feed.app)
        scrolled = t.scroll_y
        assert scrolled > 0 and cursor_key(feed.app) == "t30"

        changed = [x | {"in_flight": 7, "rejected_429": 3} for x in tenants(60)]
        await feed.send(pilot, snapshot(changed))
        await feed.send(pilot, snapshot([*changed[:59], tenant(99, 0.5)]))
        assert row_keys(t)[-1] == "t99" and "t59" not in t.rows
        assert t.scroll_y == scrolled
        assert cursor_key(feed.app) == "t30"


async def test_a_tenant_that_disappears_is_removed():
    feed = Feed(snapshot(tenants(5)))
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("down", "down")
        t = table(feed.app)
        assert cursor_key(feed.app) == "t02"

        await feed.send(pilot, snapshot([x for x in tenants(5) if x["id"] != "t01"]))
        assert row_keys(t) == ["t00", "t02", "t03", "t04"]
        assert cursor_key(feed.app) == "t02"
        assert t.border_title.startswith("tenants 4/4")

        # The tenant under the cursor goes: the cursor stays on a row that exists.
        await feed.send(pilot, snapshot([x for x in tenants(5) if x["id"] in ("t00", "t04")]))
        assert row_keys(t) == ["t00", "t04"]
        assert cursor_key(feed.app) in ("t00", "t04")

        await feed.send(pilot, snapshot([]))
        assert t.row_count == 0


async def test_changed_values_are_written_into_the_cells():
    feed = Feed(snapshot(tenants(3)))
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        t = table(feed.app)
        assert t.get_cell("t01", "rejected_429").plain == "0"

        quota = {"rpm": 100, "rpm_used": 95, "daily_tokens": 20000, "daily_used": 8000}
        busy = tenant(1, 999.0, rejected_429=12, in_flight=3, requests_per_s=2.5, quota=quota)
        await feed.send(pilot, snapshot([tenants(3)[0], busy, tenants(3)[2]]))
        assert t.get_cell("t01", "tokens_per_s").plain == fmt.si(999.0)
        assert t.get_cell("t01", "requests_per_s").plain == fmt.si(2.5)
        assert t.get_cell("t01", "in_flight").plain == "3"
        rejected = t.get_cell("t01", "rejected_429")
        assert (rejected.plain, rejected.style) == ("12", "red")
        used = t.get_cell("t01", "quota_used")
        assert (used.plain, used.style) == ("95%", "bold red")
        assert t.get_cell("t01", "budget_left").plain == fmt.tokens(12000)
        # The neighbours are untouched.
        assert t.get_cell("t00", "rejected_429").plain == "0"
        assert t.get_cell("t00", "spend_today").plain == "-"  # no spend reported

        # Spend in dollars; a money budget nearly spent makes the quota nearly used.
        quota = {"daily_spend": 0.5, "daily_spend_used": 0.42, "monthly_spend_used": 3.1}
        await feed.send(pilot, snapshot([tenants(3)[0], tenant(1, 999.0, quota=quota)]))
        assert t.get_cell("t01", "spend_today").plain == "$0.42"
        used = t.get_cell("t01", "quota_used")
        assert (used.plain, used.style) == ("84%", "yellow")
        assert t.get_cell("t01", "budget_left").plain == "unlimited"  # tokens: none set


async def test_columns_are_added_once_and_fit_what_they_show():
    long_name = "a-tenant-with-a-rather-long-name"
    feed = Feed(snapshot(tenants(3)))
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        t = table(feed.app)
        columns = list(t.columns.values())
        narrow = t.columns["name"].content_width

        await feed.send(pilot, snapshot([*tenants(3), tenant(7, 1.0, name=long_name)]))
        assert t.columns["name"].content_width == len(long_name)
        await feed.send(pilot, snapshot(tenants(3)))
        assert t.columns["name"].content_width == narrow
        assert all(a is b for a, b in zip(t.columns.values(), columns, strict=True))


async def test_resorting_keeps_the_cursor_on_its_tenant():
    # By tok/s the order is t00..t04; by req/s it is the reverse.
    rows = [tenant(i, 1000.0 - i, requests_per_s=float(i)) for i in range(5)]
    feed = Feed(snapshot(rows))
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("down")
        t = table(feed.app)
        assert cursor_key(feed.app) == "t01"

        await pilot.press("s")
        assert row_keys(t) == ["t04", "t03", "t02", "t01", "t00"]
        assert cursor_key(feed.app) == "t01" and t.cursor_row == 3
        assert str(t.columns["requests_per_s"].label) == "req/s ▼"
        assert str(t.columns["tokens_per_s"].label) == "tok/s"
        assert t.columns["tokens_per_s"].content_width == len("tok/s")


async def test_sort_mark_moves_while_the_filter_hides_every_row():
    feed = Feed(snapshot(tenants(3)))
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        await pilot.press("slash", "z", "z", "enter", "s")
        t = table(feed.app)
        assert t.row_count == 0
        assert str(t.columns["requests_per_s"].label) == "req/s ▼"
        await pilot.press("slash", "escape")
        assert row_keys(t) == ["t00", "t01", "t02"]
        assert str(t.columns["tokens_per_s"].label) == "tok/s"


async def test_markup_in_a_name_is_shown_as_typed():
    odd = "[b]acme[/b] [/]"  # as markup, the last tag would close nothing: an error
    feed = Feed(snapshot([tenant(1, 5.0, name=odd)]))
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        t = table(feed.app)
        shown = "\n".join(strip.text for strip in t.render_lines(t.region.reset_offset))
        assert odd in shown


async def test_backends_and_errors_are_updated_in_place():
    def backend(name: str, running: int, healthy: bool = True) -> dict:
        return {"name": name, "type": "gpu", "healthy": healthy, "running": running}

    def error(ts: float, message: str) -> dict:
        return {"ts": ts, "status": 429, "tenant": "acme", "model": "m", "message": message}

    first = snapshot([], [backend("gpu-0", 1), backend("gpu-1", 2)], [error(1.0, "old")])
    feed = Feed(first)
    async with feed.app.run_test(size=SIZE) as pilot:
        await played_out(pilot)
        backends = feed.app.query_one(BackendsTable)
        errors = feed.app.query_one(ErrorsTable)

        later = [error(1.0, "old"), error(2.0, "same"), error(2.0, "same")]
        await feed.send(pilot, snapshot([], [backend("gpu-1", 5, healthy=False)], later))
        assert row_keys(backends) == ["gpu-1"]
        assert backends.get_cell("gpu-1", "running").plain == "5"
        assert backends.get_cell("gpu-1", "health").plain == "DOWN"
        # Newest first, and two identical errors are two rows.
        assert [str(errors.get_row_at(i)[4]) for i in range(3)] == ["same", "same", "old"]
        assert errors.border_title == "recent errors (3)"
