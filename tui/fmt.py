"""Short, fixed-width renderings of numbers for the panels."""

from __future__ import annotations

from datetime import UTC, datetime


def si(value: float) -> str:
    """1234.5 -> '1.2k', 3 -> '3.0': always one decimal, so columns line up."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.1f}"


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.1f} ms"


def pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def usd(dollars: float | None) -> str:
    """0.4213 -> '$0.42', 1234.5 -> '$1.2k'; a spend under a cent is '<$0.01', not '$0.00'."""
    if dollars is None:
        return "-"
    if 0 < dollars < 0.01:
        return "<$0.01"
    return f"${si(dollars)}" if dollars >= 1000 else f"${dollars:.2f}"


def duration(seconds: float | None) -> str:
    """3725 -> '1h 02m'."""
    if seconds is None:
        return "-"
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {s:02d}s"


def clock(ts: float) -> str:
    """A wall-clock time in UTC, so a replayed file reads the same everywhere."""
    try:
        return datetime.fromtimestamp(ts, tz=UTC).strftime("%H:%M:%S")
    except (OverflowError, OSError, ValueError):  # not a time any clock shows
        return "?"


def tokens(value: int | None) -> str:
    return "unlimited" if value is None else si(value)
