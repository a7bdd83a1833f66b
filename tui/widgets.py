"""The panels. Each one draws a plain record from `tui.view`; the tables keep only their
rows, which they update in place so that the cursor and the scroll survive a refresh."""

from __future__ import annotations

from fractions import Fraction

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import RenderResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static

from tui import fmt
from tui.keyed_table import KeyedRow, KeyedTable
from tui.view import (
    TENANT_SORTS,
    BackendRow,
    BatchRow,
    Dashboard,
    Engine,
    ErrorRow,
    Latency,
    Series,
    TenantRow,
)

BARS = " ▁▂▃▄▅▆▇█"
SEPARATOR = Text(" │ ", "dim")

STATE_STYLE = {
    "connected": "bold green",
    "polling": "bold green",
    "replaying": "bold cyan",
    "replay finished": "bold cyan",
    "connecting": "bold yellow",
    "reconnecting": "bold yellow",
    "disconnected": "bold red",
    "refused": "bold red",
}


class StatusBar(Static):
    """Where the data comes from, the gateway's identity, and the connection state."""

    def show(self, board: Dashboard, paused: bool) -> None:
        c = board.connection
        # The title, a replay's mark and file, and the gateway, each set apart.
        replay = (
            [(" REPLAY ", "bold reverse cyan"), f" {board.replay}", SEPARATOR]
            if board.replay is not None
            else []
        )
        line1 = Text.assemble(
            ("kvgate top", "bold"),
            SEPARATOR,
            *replay,
            f"gateway {board.url}",
            f"  v{board.version}" if board.version else "",
            f"  up {fmt.duration(board.uptime_s)}",
            f"  backends {board.backends_up}/{len(board.backends)}",
            f"  in flight {board.in_flight}",
            f"  models: {', '.join(board.models) or '-'}",
        )
        line2 = Text.assemble(("● " + c.state, STATE_STYLE.get(c.state, "bold")))
        if c.state == "disconnected":
            line2.append(f"  {c.error}, retry in {c.retry_in_s:g}s (attempt {c.attempt})")
        elif c.state == "refused":
            line2.append(f"  not retrying (q quits): {c.error}")
        elif c.state == "reconnecting":
            line2.append(f"  (last error: {c.error})")
        if paused:
            line2.append("  PAUSED", "bold reverse")
        self.update(Text("\n").join([line1, line2]))


class RateChart(Widget):
    """A bar chart of one rate over time, newest on the right, scaled from zero."""

    DEFAULT_CSS = "RateChart { height: 1fr; color: $accent; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.values: list[float] = []

    def plot(self, values: list[float]) -> None:
        self.values = values
        self.refresh()

    def render(self) -> RenderResult:
        width, height = self.size.width, self.size.height
        columns = _fit(self.values, width)
        top = max(columns, default=0.0)
        eighths = [round(v / top * height * 8) if top > 0 else 0 for v in columns]
        pad = " " * (width - len(columns))
        rows = [
            pad + "".join(BARS[min(max(e - row * 8, 0), 8)] for e in eighths)
            for row in range(height - 1, -1, -1)
        ]
        return Text("\n".join(rows))


def _fit(values: list[float], width: int) -> list[float]:
    """At most `width` columns: one per value, or the mean of each slice when there are more."""
    if len(values) <= width:
        return values
    step = Fraction(len(values), width)
    slices = [values[int(step * i) : int(step * (i + 1))] for i in range(width)]
    return [sum(s) / len(s) for s in slices]


class ChartPanel(Vertical):
    def compose(self):
        yield RateChart()

    def show(self, series: Series, window_s: float) -> None:
        self.border_title = f"{series.label} {fmt.si(series.current)} {series.unit}"
        peak = fmt.si(max(series.values, default=0.0))
        self.border_subtitle = f"last {fmt.duration(window_s)}, max {peak}"
        self.query_one(RateChart).plot(series.values)


class LatencyPanel(Static):
    def show(self, latency: Latency) -> None:
        table = Table.grid(padding=(0, 2))
        table.add_column()
        table.add_column(justify="right")
        table.add_column(justify="right")
        table.add_row("", Text("p50", "bold"), Text("p99", "bold"))
        table.add_row("TTFT", fmt.ms(latency.ttft_p50_ms), fmt.ms(latency.ttft_p99_ms))
        table.add_row("TPOT", fmt.ms(latency.tpot_p50_ms), fmt.ms(latency.tpot_p99_ms))
        table.add_row("E2E", fmt.ms(latency.e2e_p50_ms), fmt.ms(latency.e2e_p99_ms))
        self.update(table)


class EnginePanel(Static):
    def show(self, engine: Engine) -> None:
        table = Table.grid(padding=(0, 2))
        table.add_column()
        table.add_column(justify="right")
        filled = round(engine.kv_usage * 10)
        kv = Text.assemble(("█" * filled, "bold"), ("░" * (10 - filled), "dim"))
        table.add_row("running", str(engine.running))
        table.add_row("waiting", str(engine.waiting))
        table.add_row("KV cache", Text.assemble(kv, f" {fmt.pct(engine.kv_usage):>4}"))
        table.add_row("prefix hits", fmt.pct(engine.prefix_hit_rate))
        table.add_row("preemptions", str(engine.preemptions))
        if engine.transfers is not None:  # a decode worker's pulls of prefilled blocks
            t = engine.transfers
            table.add_row("block pulls", f"{fmt.si(t.pulls)} ({t.fallbacks} failed)")
            table.add_row("pulled", f"{fmt.si(t.bytes)}B in {t.seconds:.1f} s")
        parts = [table]
        if engine.tiers:
            tiers = Table.grid(padding=(0, 2))
            tiers.add_column()
            for _ in range(3):
                tiers.add_column(justify="right")
            tiers.add_row("KV tier", *(Text(h, "bold") for h in ("hits", "blocks", "bytes")))
            for t in engine.tiers:
                tiers.add_row(t.tier, fmt.si(t.hits), fmt.si(t.blocks), f"{fmt.si(t.bytes)}B")
            parts.append(tiers)
        self.update(Group(*parts))

    @staticmethod
    def height(engine: Engine) -> int:
        """Rows the panel takes, its border included: the five of every engine, two of
        block pulls where a decode worker pulls them, then a header and a row per KV
        tier where some tier is on."""
        tiers = 1 + len(engine.tiers) if engine.tiers else 0
        return 7 + 2 * (engine.transfers is not None) + tiers


class TenantsTable(KeyedTable):
    COLUMNS = [
        ("name", "tenant"),
        ("requests_per_s", "req/s"),
        ("tokens_per_s", "tok/s"),
        ("rejected_429", "429s"),
        ("in_flight", "in flight"),
        ("quota_used", "quota"),
        ("budget_left", "budget left"),
        ("spend_today", "spend today"),
        ("served", "served"),
    ]

    def on_mount(self) -> None:
        # KeyedTable.on_mount adds the columns: Textual runs each class's handler.
        self.cursor_type = "row"
        self.zebra_stripes = True

    def show(self, board: Dashboard) -> None:
        marked = {k: f"{t} ▼" if k == board.sort_key else t for k, t in self.COLUMNS}
        self.relabel(marked)
        self.sync([KeyedRow(t.id, _tenant_cells(t)) for t in board.tenants])
        sort_title = dict(TENANT_SORTS)[board.sort_key]
        shown = f"{len(board.tenants)}/{board.tenant_count}"
        where = f" matching '{board.tenant_filter}'" if board.tenant_filter else ""
        self.border_title = f"tenants {shown}{where}, by {sort_title}"


def _tenant_cells(t: TenantRow) -> list[Text]:
    return [
        Text(t.name),
        Text(fmt.si(t.requests_per_s), justify="right"),
        Text(fmt.si(t.tokens_per_s), justify="right"),
        Text(str(t.rejected_429), "red" if t.rejected_429 else "", justify="right"),
        Text(str(t.in_flight), justify="right"),
        Text(fmt.pct(t.quota_used), _quota_style(t.quota_used), justify="right"),
        Text(fmt.tokens(t.budget_left), justify="right"),
        Text(fmt.usd(t.spend_today), "" if t.spend_today is not None else "dim", justify="right"),
        Text(fmt.pct(t.served), "" if t.served is not None else "dim", justify="right"),
    ]


def _quota_style(share: float | None) -> str:
    if share is None:
        return "dim"
    return "bold red" if share >= 0.9 else "yellow" if share >= 0.7 else ""


class BackendsTable(KeyedTable):
    COLUMNS = [
        ("name", "backend"),
        ("type", "type"),
        ("health", "health"),
        ("running", "running"),
        ("queue", "queue"),
        ("kv", "KV"),
        ("gen", "gen tok/s"),
    ]

    def on_mount(self) -> None:
        self.cursor_type = "none"

    def show(self, backends: list[BackendRow]) -> None:
        self.sync([KeyedRow(b.name, _backend_cells(b)) for b in backends])


def _backend_cells(b: BackendRow) -> list[Text]:
    return [
        Text(b.name),
        Text(b.type),
        Text("up", "green") if b.healthy else Text("DOWN", "bold red"),
        Text(str(b.running), justify="right"),
        Text(str(b.waiting), justify="right"),
        Text(fmt.pct(b.kv_usage), justify="right"),
        Text(fmt.si(b.gen_tokens_per_s), justify="right"),
    ]


class ErrorsTable(KeyedTable):
    COLUMNS = [
        ("time", "time (UTC)"),
        ("status", "status"),
        ("tenant", "tenant"),
        ("model", "model"),
        ("message", "message"),
    ]

    def on_mount(self) -> None:
        self.cursor_type = "none"

    def show(self, errors: list[ErrorRow]) -> None:
        # An error has no id and never changes: its content is its key (sync numbers repeats).
        self.sync([KeyedRow(_error_key(e), _error_cells(e)) for e in errors])
        self.border_title = f"recent errors ({len(errors)})"


def _error_key(e: ErrorRow) -> str:
    return "\x1f".join((repr(e.ts), str(e.status), e.tenant, e.model, e.message))


def _error_cells(e: ErrorRow) -> list[Text]:
    return [
        Text(fmt.clock(e.ts)),
        Text(str(e.status), "red"),
        Text(e.tenant),
        Text(e.model),
        Text(e.message),
    ]


BAR_WIDTH = 12
BATCH_STATUS_STYLE = {"completed": "green", "failed": "red", "expired": "red"}
BATCH_STATUS_STYLE |= {"in_progress": "bold", "cancelling": "yellow", "cancelled": "dim"}


class BatchesTable(KeyedTable):
    """Every tenant's batches (the Batch API's), running ones first: progress as a bar of
    the lines answered (failed ones red), the output and error files, the batch price
    billed so far. Shown only while the gateway reports a batch."""

    COLUMNS = [
        ("id", "batch"),
        ("tenant", "tenant"),
        ("status", "status"),
        ("progress", "progress"),
        ("lines", "done/failed/total"),
        ("spend", "spend (batch price)"),
        ("files", "output / error file"),
    ]

    def on_mount(self) -> None:
        self.cursor_type = "none"

    def show(self, batches: list[BatchRow]) -> None:
        self.display = bool(batches)
        self.sync([KeyedRow(b.id, _batch_cells(b)) for b in batches])
        running = sum(b.status in ("validating", "in_progress", "finalizing") for b in batches)
        self.border_title = f"batches ({running} running, {len(batches)} shown)"


def progress_bar(b: BatchRow, width: int = BAR_WIDTH) -> Text:
    """Completed lines green, failed red, the rest dim, and the share answered."""
    if not b.total:
        return Text("-", "dim")
    ok = b.completed * width // b.total
    bad = min(width - ok, -(-b.failed * width // b.total))  # a failure shows, however few
    return Text.assemble(
        ("█" * ok, "green"),
        ("█" * bad, "red"),
        ("░" * (width - ok - bad), "dim"),
        f" {fmt.pct(b.done)}",
    )


def _batch_cells(b: BatchRow) -> list[Text]:
    files = f"{b.output_file_id or '-'} / {b.error_file_id or '-'}"
    return [
        Text(b.id),
        Text(b.tenant),
        Text(b.status, BATCH_STATUS_STYLE.get(b.status, "")),
        progress_bar(b),
        Text(f"{b.completed}/{b.failed}/{b.total}", justify="right"),
        Text(fmt.usd(b.spend), justify="right"),
        Text(files, "" if b.output_file_id or b.error_file_id else "dim"),
    ]
