"""`kvgate top`: the Textual app. It owns the key bindings and hands each panel its record."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, Static

from tui.source import StatsSource
from tui.view import TENANT_SORTS, Dashboard
from tui.widgets import (
    BackendsTable,
    BatchesTable,
    ChartPanel,
    EnginePanel,
    ErrorsTable,
    LatencyPanel,
    StatusBar,
    TenantsTable,
)

HELP = """\
[b]kvgate top[/b]: live view of a kvgate gateway

  [b]q[/b]   quit
  [b]p[/b]   pause / resume (the view freezes; a replay holds)
  [b]s[/b]   sort tenants: tok/s, req/s, 429s, quota, spend today, name
  [b]/[/b]   filter tenants by name or id (enter keeps it, escape clears it)
  [b]S[/b]   save an SVG screenshot in --screenshot-dir (default: current directory)
  [b]?[/b]   this help

Rates are over the gateway's last 10 s (tokens count as they are generated),
latency percentiles over its last 60 s.
Quota is the fullest of a tenant's limits, money budgets included; spend today
is in US dollars since 00:00 UTC.
Charts show the last few minutes, newest on the right.

[dim]escape or ? closes this window[/dim]"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close"),
        Binding("q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")


class DashboardScreen(Screen[None]):
    """Every panel, redrawn from the source's `Dashboard` record whenever new stats arrive."""

    AUTO_FOCUS = "#tenants"
    BINDINGS = [
        Binding("p", "pause", "Pause"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("question_mark", "help", "Help"),
    ]

    def __init__(self, source: StatsSource) -> None:
        super().__init__()
        self.source = source
        self.paused = False
        self.sort_key = TENANT_SORTS[0][0]
        self.tenant_filter = ""
        self._redraw_pending = False

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        with Horizontal(id="charts"):
            yield ChartPanel(id="chart-output", classes="panel")
            yield ChartPanel(id="chart-prompt", classes="panel")
            yield ChartPanel(id="chart-requests", classes="panel")
        with Horizontal(id="middle"):
            yield LatencyPanel(id="latency", classes="panel")
            yield EnginePanel(id="engine", classes="panel")
            yield BackendsTable(id="backends", classes="panel")
        with Vertical(id="lower"):
            yield TenantsTable(id="tenants", classes="panel")
            yield BatchesTable(id="batches", classes="panel")
            yield ErrorsTable(id="errors", classes="panel")
        yield Input(placeholder="filter tenants (enter: keep, escape: clear)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#latency").border_title = "latency"
        self.query_one("#engine").border_title = "engine"
        self.query_one("#backends").border_title = "backends"
        self.source.on_change = self._source_changed
        self.redraw()
        # A worker of this screen, so it stops before the panels go away. The source
        # catches its own errors; exit_on_error=False is the last guard.
        self.run_worker(self.source.run(), name="stats", exit_on_error=False)

    def on_unmount(self) -> None:
        self.source.on_change = None

    def _source_changed(self) -> None:
        # Many snapshots can arrive between two frames (a fast replay): draw once for them.
        if not self.paused and not self._redraw_pending:
            self._redraw_pending = True
            self.call_later(self._redraw_pending_changes)

    def _redraw_pending_changes(self) -> None:
        self._redraw_pending = False
        if not self.paused:
            self.redraw()

    def redraw(self) -> None:
        board: Dashboard = self.source.dashboard(self.sort_key, self.tenant_filter)
        # Stale numbers get red frames, so nobody mistakes them for live ones.
        self.set_class(board.connection.state in ("disconnected", "refused"), "-disconnected")
        self.query_one(StatusBar).show(board, self.paused)
        for panel, series in zip(self.query(ChartPanel), board.throughput, strict=True):
            panel.show(series, board.window_s)
        self.query_one(LatencyPanel).show(board.latency)
        self.query_one(EnginePanel).show(board.engine)
        self.query_one("#middle").styles.height = EnginePanel.height(board.engine)
        self.query_one(TenantsTable).show(board)
        self.query_one(BackendsTable).show(board.backends)
        self.query_one(ErrorsTable).show(board.errors)
        self.query_one(BatchesTable).show(board.batches)

    # -- keys ------------------------------------------------------------------

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.source.paused = self.paused
        self.redraw()

    def action_cycle_sort(self) -> None:
        keys = [key for key, _ in TENANT_SORTS]
        self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)]
        self.redraw()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def action_clear_filter(self) -> None:
        """Escape: drop the filter, whether it is being typed or was kept with enter."""
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.tenant_filter = ""
        self.query_one(TenantsTable).focus()
        self.redraw()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    def on_input_changed(self, event: Input.Changed) -> None:
        self.tenant_filter = event.value
        self.redraw()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.display = False
        self.query_one(TenantsTable).focus()


class TopApp(App[None]):
    CSS_PATH = "top.tcss"
    TITLE = "kvgate top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [Binding("q", "quit", "Quit"), Binding("S", "save_svg", "Screenshot")]

    def __init__(self, source: StatsSource, screenshot_dir: Path = Path(".")) -> None:
        super().__init__()
        self.source = source
        self.screenshot_dir = screenshot_dir
        self.dashboard = DashboardScreen(source)

    def get_default_screen(self) -> Screen:
        return self.dashboard

    def action_save_svg(self) -> None:
        """Save the screen as it is now; the file is named by the local time."""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = self.screenshot_dir / f"kvgate-top-{stamp}.svg"
        copies = 1
        while path.exists():  # two in one second
            copies += 1
            path = self.screenshot_dir / f"kvgate-top-{stamp}-{copies}.svg"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.save_screenshot(filename=path.name, path=str(path.parent))
        except OSError as e:
            self.notify(f"cannot save a screenshot: {e}", severity="error")
            return
        self.notify(str(path), title="screenshot saved")
