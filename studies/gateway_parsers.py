"""What the output parsers cost (issue 48): the gateway with a reasoning and a tool-call
parser on against none, on the fake backend.

    python -m studies.gateway_overhead --parsers qwen3,hermes [--duration 10] [--rounds 1]

Two `kvgate serve --backend fake` processes, pinned to CPU 0 as gateway_overhead's are:
"off" names no parser, "on" names them (--reasoning-parser, --tool-call-parser). Each
request's mock_response is the same Qwen3-style reply (reasoning, a sentence, a
`<tool_call>`; 81 tokens) and offers one tool: "on" asks tool_choice "auto", so both
parsers read every token, "off" asks "none", so none does. A closed loop of 64
connections from CPU 1 drives each in turn, A B B A per round, chat whole and streamed;
the figures are requests/s and the gateway process's CPU seconds per request (the loaded
machine's requests/s move with its neighbours; its CPU per request much less).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from studies.gateway_load import CHAT_PATH, cpu_seconds, start_server, wait_up
from studies.harness import ADMIN_KEY, free_port, tenant_key

MOCK = (
    "<think>\nThe user wants the weather in Paris. The get_weather tool gives it, so I "
    "call it with the city and the unit they use there.\n</think>\n\nLet me check the "
    'weather for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    '"Paris", "unit": "celsius"}}\n</tool_call>'
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        },
    },
}
CONNS = 64


def body(parsed: bool, stream: bool) -> dict:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 200,
        "tools": [TOOL],
        "tool_choice": "auto" if parsed else "none",
        "stream": stream,
        "mock_response": MOCK,
    }


def start(port: int, tmp: Path, parsers: list[str]) -> tuple[object, str]:
    """`kvgate serve --backend fake`, with the parsers named when there are any."""
    env = {"KVGATE_ADMIN_KEY": ADMIN_KEY}
    env["KVGATE_DATABASE_URL"] = f"sqlite+aiosqlite:///{tmp / f'parsers-{port}.db'}"
    args = ["gateway.cli", "serve", "--backend", "fake", "--port", str(port)]
    if parsers:
        args += ["--reasoning-parser", parsers[0], "--tool-call-parser", parsers[1]]
    proc = start_server(args, os.environ | env)
    url = f"http://127.0.0.1:{port}"
    wait_up(url)
    return proc, tenant_key(url)


async def closed_loop(url: str, key: str, payload: dict, duration: float) -> int:
    """Requests answered in `duration` s by CONNS connections, each posting its next
    request when its last answer has been read whole."""
    headers = {"Authorization": f"Bearer {key}"}
    done = 0
    end = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNS)) as http:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                async with http.post(url + CHAT_PATH, json=payload, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                done += 1

        await asyncio.gather(*(worker() for _ in range(CONNS)))
    return done


def one(server: tuple, parsed: bool, stream: bool, duration: float) -> dict:
    proc, url, key = server
    payload = body(parsed, stream)
    asyncio.run(closed_loop(url, key, payload, 1))  # warm up
    cpu0 = cpu_seconds(proc.pid)
    n = asyncio.run(closed_loop(url, key, payload, duration))
    cpu = cpu_seconds(proc.pid) - cpu0
    return {"requests": n, "rps": n / duration, "cpu_ms_per_request": 1000 * cpu / max(n, 1)}


def compare(args: argparse.Namespace) -> dict:
    """A B B A per round for each of whole and streamed chat; ratios of on over off."""
    parsers = args.parsers.split(",")
    if len(parsers) != 2:
        raise SystemExit("--parsers REASONING,TOOLS (e.g. qwen3,hermes)")
    with tempfile.TemporaryDirectory() as d:
        servers = {}
        for name, names in (("off", []), ("on", parsers)):
            port = free_port()
            proc, key = start(port, Path(d), names)
            servers[name] = (proc, f"http://127.0.0.1:{port}", key)
        try:
            runs: dict[str, dict[str, list[dict]]] = {}
            for stream in (False, True):
                mode = "streamed" if stream else "whole"
                runs[mode] = {"off": [], "on": []}
                for _ in range(args.rounds):
                    for name in ("off", "on", "on", "off"):
                        got = one(servers[name], name == "on", stream, args.duration)
                        runs[mode][name].append(got)
                        print(mode, name, got, flush=True)
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
                proc.wait()
    summary = {}
    for mode, sides in runs.items():
        off, on = sides["off"], sides["on"]
        rps = sum(r["requests"] for r in on) / sum(r["requests"] for r in off)
        cpu_off = sum(r["cpu_ms_per_request"] for r in off) / len(off)
        cpu_on = sum(r["cpu_ms_per_request"] for r in on) / len(on)
        summary[mode] = {
            "rps_on_over_off": round(rps, 3),
            "cpu_ms_per_request": {"off": round(cpu_off, 3), "on": round(cpu_on, 3)},
            "cpu_off_over_on": round(cpu_off / cpu_on, 3),
        }
    return {"parsers": parsers, "duration_s": args.duration, "runs": runs, "summary": summary}
