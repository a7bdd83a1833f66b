"""`kvgate top`: a live terminal dashboard of a kvgate gateway, over HTTP only."""

from tui.cli import main
from tui.source import StatsSource, load_replay

__all__ = ["StatsSource", "load_replay", "main"]
