"""`kvgate serve --workers N`: the engine runs as N supervised `kvgate worker` processes
behind the gateway's remote replicas; a worker that is killed comes back, and requests
keep being served by the other meanwhile."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import psutil

from tests.conftest import start_gateway


def _workers(gw) -> list[psutil.Process]:
    children = psutil.Process(gw.proc.pid).children(recursive=True)
    return [p for p in children if "worker" in p.cmdline()]


def test_serve_with_two_workers(tmp_path):
    gw = start_gateway(tmp_path, "--backend", "fake", "--workers", "2", timeout=120)
    try:
        workers = _workers(gw)
        assert len(workers) == 2
        backends = httpx.get(gw.url + "/admin/backends", headers=gw.admin_headers).json()
        names = [b["name"] for b in backends["data"]]
        assert len(names) == 2 and all("@127.0.0.1:" in n for n in names), names
        _, key = gw.tenant_key("acme")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        for _ in range(4):
            out = client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert out.usage.completion_tokens == 3
        os.kill(workers[0].pid, signal.SIGKILL)
        for _ in range(6):  # the other worker serves; the gateway retries before output
            out = client.completions.create(model="fake-model", prompt="hello", max_tokens=2)
            assert out.usage.completion_tokens == 2
        deadline = time.monotonic() + 60
        while len(_workers(gw)) < 2 or workers[0].pid in [p.pid for p in _workers(gw)]:
            assert time.monotonic() < deadline, "the killed worker was not restarted"
            time.sleep(0.2)
        usage = httpx.get(gw.url + "/admin/usage", headers=gw.admin_headers).json()
        assert usage["total"]["requests"] == 10
        workers = _workers(gw)
    finally:
        gw.stop()
    assert not [p for p in workers if p.is_running()]  # stopping the gateway stops them
