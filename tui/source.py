"""The dashboard's one data source: a live gateway or a recorded file, no widgets.

Live: follows `GET /admin/stats/stream` (SSE) and falls back to polling
`GET /admin/stats` when the stream route is missing; on any failure it reports
the error, waits (exponential backoff) and connects again, except when the gateway
refuses the key (401, 403): the same key would be refused again, so it stops. Replay: plays a JSON
Lines file of snapshots with their recorded spacing, scaled by `speed`.
Either way it keeps the last minutes of rates for the charts and hands the
widgets a plain `Dashboard` record.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from tui.view import TENANT_SORTS, Connection, Dashboard, build_dashboard


class GatewayError(Exception):
    """The gateway answered, but not with stats (wrong key, unknown route, server error);
    `status` is its HTTP status."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    @property
    def refused_key(self) -> bool:
        """The key is wrong or not an admin key: trying again cannot help."""
        return self.status in (401, 403)


def load_replay(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON Lines stats file; a line that is not a JSON object is a ValueError."""
    snapshots = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                snapshot = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(snapshot, dict):
                raise ValueError(f"{path}:{lineno}: a snapshot must be a JSON object")
            snapshots.append(snapshot)
    if not snapshots:
        raise ValueError(f"{path}: no snapshots in the file")
    return snapshots


def describe(error: BaseException) -> str:
    """One line for the status bar; never a traceback."""
    if isinstance(error, aiohttp.ClientConnectorError):
        errno = error.os_error.errno
        reason = os.strerror(errno).lower() if errno else str(error.os_error)
        return f"cannot connect to {error.host}:{error.port} ({reason})"
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "the gateway closed the connection"
    if isinstance(error, TimeoutError):
        return "the gateway stopped answering (timed out)"
    text = str(error) or type(error).__name__
    return text if isinstance(error, GatewayError) else f"{type(error).__name__}: {text}"


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    if resp.status == 200:
        return
    message = resp.reason or ""
    try:
        body = await resp.json(content_type=None)
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        pass
    if resp.status in (401, 403):
        message = (
            f"admin key rejected: {message}; kvgate top needs the gateway's admin key "
            "(--admin-key or KVGATE_ADMIN_KEY)"
        )
    raise GatewayError(f"HTTP {resp.status}: {message}", resp.status)


async def key_refused(url: str, admin_key: str | None) -> str | None:
    """Why the gateway refuses `admin_key` for its stats (one line), or None: checked
    before the dashboard starts, as a refused key is not worth retrying. A gateway that
    cannot be reached is None here: the dashboard shows that and keeps trying."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        async with (
            aiohttp.ClientSession(headers=headers, timeout=timeout) as http,
            http.get(url.rstrip("/") + "/admin/stats") as resp,
        ):
            await _raise_for_status(resp)
    except GatewayError as e:
        return str(e) if e.refused_key else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return None


class StatsSource:
    """Feeds the dashboard from a gateway URL, or from `replay` snapshots when given.

    `record`, when given, gets every snapshot taken as one JSON line: a file to replay.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        admin_key: str | None = None,
        *,
        replay: list[dict[str, Any]] | None = None,
        replay_name: str = "",
        speed: float = 1.0,
        interval: float = 1.0,
        history_s: float = 300.0,
        backoff_s: tuple[float, float] = (0.5, 10.0),
        record: TextIO | None = None,
    ) -> None:
        assert interval > 0 and speed >= 0 and history_s > 0
        self.url = url.rstrip("/")
        self.admin_key = admin_key
        self.replay = replay
        self.replay_name = replay_name
        self.speed = speed
        self.interval = interval
        self.history_s = history_s
        self.backoff_s = backoff_s
        # A stalled gateway must look like a failure, not like a quiet minute.
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=5, sock_read=5 + 3 * interval
        )
        self.record = record
        self.on_change: Callable[[], None] | None = None
        self.paused = False
        self.snapshot: dict[str, Any] | None = None
        self.history: deque[tuple[float, float, float, float]] = deque()
        self.received = 0
        self.connection = Connection("replaying" if replay is not None else "connecting")

    # -- what the widgets get --------------------------------------------------

    def dashboard(self, sort_key: str = TENANT_SORTS[0][0], tenant_filter: str = "") -> Dashboard:
        replay = self.replay_name if self.replay is not None else None
        return build_dashboard(
            self.snapshot, self.history, self.connection, replay, self.url, sort_key, tenant_filter
        )

    def ingest(self, snapshot: dict[str, Any]) -> None:
        """Take one snapshot: remember it and add its rates to the chart history."""
        if not isinstance(snapshot, dict):
            raise ValueError(
                f"a stats snapshot must be a JSON object, got {type(snapshot).__name__}"
            )
        rates = snapshot.get("rates")
        rates = rates if isinstance(rates, dict) else {}
        ts = snapshot.get("ts")
        ts = float(ts) if isinstance(ts, int | float) else self._last_ts() + self.interval
        if self.history and ts < self.history[-1][0]:
            self.history.clear()  # the clock went back (another gateway, a restart): start over
        self.history.append(
            (
                ts,
                _rate(rates, "requests_per_s"),
                _rate(rates, "prompt_tokens_per_s"),
                _rate(rates, "output_tokens_per_s"),
            )
        )
        while self.history[0][0] < ts - self.history_s:
            self.history.popleft()
        self.snapshot = snapshot
        self.received += 1
        if self.record is not None:
            self.record.write(json.dumps(snapshot, separators=(",", ":")) + "\n")
            self.record.flush()  # a recording cut short by ^C still replays
        self._changed()

    # -- the loops ---------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled (live) or until the file is played out (replay)."""
        if self.replay is not None:
            await self._play()
        else:
            await self._follow()

    async def _play(self) -> None:
        assert self.replay is not None
        previous_ts: float | None = None
        for i, snapshot in enumerate(self.replay):
            ts = snapshot.get("ts")
            if self.speed > 0 and previous_ts is not None and isinstance(ts, int | float):
                # A long gap in the recording is not worth waiting out.
                await asyncio.sleep(min(max(ts - previous_ts, 0.0), 10.0) / self.speed)
            while self.paused:
                await asyncio.sleep(0.05)
            previous_ts = ts if isinstance(ts, int | float) else previous_ts
            self.ingest(snapshot)
            if i % 50 == 49:
                await asyncio.sleep(0)  # at speed 0, keep the keys answering on a long file
        self._set_connection(Connection("replay finished"))

    async def _follow(self) -> None:
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        first_delay, max_delay = self.backoff_s
        delay = first_delay
        attempt = 0
        async with aiohttp.ClientSession(headers=headers) as session:
            while True:
                attempt += 1
                received_before = self.received
                try:
                    await self._stream(session)
                    error = "the gateway ended the stats stream"
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # whatever goes wrong, the dashboard stays up
                    error = describe(e)
                    if isinstance(e, GatewayError) and e.refused_key:
                        self._set_connection(Connection("refused", error, None, attempt))
                        return  # the same key would be refused again: no retries
                if self.received > received_before:
                    delay, attempt = first_delay, 1  # it worked for a while: start backoff over
                self._set_connection(Connection("disconnected", error, delay, attempt))
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_delay)
                self._set_connection(Connection("reconnecting", error, None, attempt))

    async def _stream(self, session: aiohttp.ClientSession) -> None:
        url = f"{self.url}/admin/stats/stream"
        params = {"interval": self.interval}
        async with session.get(url, params=params, timeout=self._timeout) as resp:
            if resp.status in (404, 405):
                return await self._poll(session)
            await _raise_for_status(resp)
            self._set_connection(Connection("connected"))
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer = (buffer + chunk).replace(b"\r\n", b"\n")
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    data = [
                        line[5:].removeprefix(b" ")
                        for line in event.split(b"\n")
                        if line.startswith(b"data:")
                    ]
                    if data:  # lines starting with ':' are keep-alive comments
                        self.ingest(json.loads(b"\n".join(data)))

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        while True:
            async with session.get(f"{self.url}/admin/stats", timeout=self._timeout) as resp:
                await _raise_for_status(resp)
                snapshot = await resp.json(content_type=None)
            if self.connection.state != "polling":
                self._set_connection(Connection("polling"))
            self.ingest(snapshot)
            await asyncio.sleep(self.interval)

    # -- helpers -----------------------------------------------------------------

    def _last_ts(self) -> float:
        return self.history[-1][0] if self.history else 0.0

    def _set_connection(self, connection: Connection) -> None:
        self.connection = connection
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()


def _rate(rates: dict[str, Any], key: str) -> float:
    value = rates.get(key)
    return float(value) if isinstance(value, int | float) else 0.0
