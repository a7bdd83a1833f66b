"""`kvgate top` arguments; `gateway.cli` hands them to `main`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tui.app import TopApp


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvgate top",
        allow_abbrev=False,  # as every kvgate command (gateway.cli.parsing)
        description="Live dashboard of a running kvgate gateway (or of a recorded stats file).",
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the gateway (default %(default)s)"
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("KVGATE_ADMIN_KEY"),
        help="the gateway's admin key (default: $KVGATE_ADMIN_KEY)",
    )
    parser.add_argument(
        "--replay",
        metavar="FILE",
        type=Path,
        help="play a JSON Lines file of stats snapshots instead of connecting",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="replay speed; 2 plays twice as fast, 0 as fast as possible (default %(default)s)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between snapshots from the gateway (default %(default)s)",
    )
    parser.add_argument(
        "--record",
        metavar="FILE",
        type=Path,
        help="append every snapshot from the gateway to FILE (JSON Lines, for --replay)",
    )
    parser.add_argument(
        "--screenshot",
        metavar="SVG",
        type=Path,
        help="with --replay: play the whole file, save the screen as SVG, and exit",
    )
    parser.add_argument(
        "--screenshot-dir",
        metavar="DIR",
        type=Path,
        default=Path("."),
        help="where the S key saves SVG screenshots (default: the current directory)",
    )
    parser.add_argument(
        "--size",
        default="140x42",
        help="terminal size for --screenshot, COLUMNSxROWS (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.screenshot is not None and args.replay is None:
        parser.error("--screenshot needs --replay")
    if args.record is not None and args.replay is not None:
        parser.error("--record takes a live gateway, not --replay")
    try:
        columns, rows = (int(n) for n in args.size.lower().split("x"))
    except ValueError:
        parser.error(f"--size must look like 140x42, not {args.size!r}")
    args.size = (columns, rows)
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    if args.speed < 0:
        parser.error("--speed must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Imported here so that `kvgate --help` does not pay for Textual.
    from tui.app import TopApp
    from tui.source import StatsSource, key_refused, load_replay

    if args.replay is not None:
        try:
            snapshots = load_replay(args.replay)
        except (OSError, ValueError) as e:
            print(f"kvgate top: {e}", file=sys.stderr)
            return 2
        source = StatsSource(
            args.url,
            replay=snapshots,
            replay_name=args.replay.name,
            speed=args.speed,
            interval=args.interval,
        )
    else:
        if why := asyncio.run(key_refused(args.url, args.admin_key)):
            print(f"kvgate top: {args.url}: {why}", file=sys.stderr)
            return 1
        source = StatsSource(args.url, args.admin_key, interval=args.interval)
    if args.screenshot is not None:
        source.speed = 0
        asyncio.run(save_screenshot(TopApp(source), args.screenshot, args.size))
        print(f"kvgate top: wrote {args.screenshot}")
        return 0
    try:
        source.record = open(args.record, "a", encoding="utf-8") if args.record else None  # noqa: SIM115
    except OSError as e:
        print(f"kvgate top: cannot record: {e}", file=sys.stderr)
        return 2
    try:
        TopApp(source, args.screenshot_dir).run()
    finally:
        if source.record is not None:
            source.record.close()
    return 0


async def save_screenshot(app: TopApp, path: Path, size: tuple[int, int]) -> None:
    """Play the replay to its end in a headless terminal of `size`, then save the screen."""
    async with app.run_test(size=size) as pilot:
        while app.source.connection.state != "replay finished":
            await pilot.pause(0.05)
        await pilot.pause()
        app.save_screenshot(filename=path.name, path=str(path.parent or "."))
