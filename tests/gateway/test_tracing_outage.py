"""A `kvgate serve` whose OTLP collector is down: one log line when spans stop reaching it,
none per retry or per batch, and one line when it answers again (issue 46.8).

The collector's port first holds a listener that accepts each connection and closes it,
as a collector going away does (the exporter's connection-error retries, as for a port
nobody listens on), counting them so the test knows batches were tried; then a real
OTLP/HTTP receiver takes the same port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import httpx

from studies.otlp_collector import HttpCollector
from tests.conftest import free_port, start_gateway

DOWN = "traces cannot be sent to"
BACK = "again ("


class Hangup:
    """A TCP port that accepts every connection and closes it at once."""

    def __init__(self, port: int) -> None:
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", port))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._sock.close()
        self._thread.join(10)


def until(done: Callable[[], bool], send: Callable[[], None], what: str) -> None:
    """Send requests (each makes spans) until `done`."""
    deadline = time.monotonic() + 120
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        send()
        time.sleep(0.2)


def test_a_down_collector_is_logged_once_and_its_recovery_once(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/traces"
    hangup = Hangup(port)
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: a batch soon after each request
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2",  # s: a batch given up after two tries
    }
    gw = start_gateway(tmp_path, "--backend", "fake", extra_env=env)
    try:
        _, key = gw.tenant_key("traced")
        http = httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {key}"})
        model = http.get("/v1/models").json()["data"][0]["id"]

        def send() -> None:
            body = {"model": model, "prompt": "hello", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 200

        def log() -> str:
            return gw.log.read_text()

        # many batches tried and dropped: two connections a try, two tries a batch
        until(lambda: hangup.connections >= 12, send, "a dozen export connections")
        until(lambda: DOWN in log(), send, "the collector said to be down")
        hangup.close()
        assert log().count(DOWN) == 1, log()
        assert "Transient error" not in log() and "Failed to export" not in log()
        assert url in next(line for line in log().splitlines() if DOWN in line)

        collector = HttpCollector()
        collector.port, collector.url = port, url  # the same address, answering now
        with collector:
            until(lambda: BACK in log() and collector.count() > 0, send, "spans delivered")
            until(lambda: collector.count() > 10, send, "more spans delivered")
        back = [line for line in log().splitlines() if BACK in line]
        assert len(back) == 1 and f"traces reach {url} again (" in back[0], log()
        assert log().count(DOWN) == 1
        http.close()
    finally:
        gw.stop()
