"""Issue 45's billing items as `python -m studies.hostile_surfaces` tries them, with a
tenant's key and the admin key, from outside the gateway:

1. a client that hangs up while its long prompt is prefilled (chat and Messages streamed,
   Responses whole) or while its hundreds of inputs are embedded: what the usage row
   bills, and, for a prompt, how much of the same prompt the next request finds cached;
2. an adapter deleted while its request streams: the request's spend;
3. an adapter whose weights file is cut short after registration: what chat and Messages
   answer, what the rows bill and what GET /admin/adapters says.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import httpx

from bench.datasets import WORDS
from studies.harness import ADMIN_KEY
from studies.hostile_surfaces_setup import (
    EMBED,
    FAKE,
    TINY,
    Gateway,
    Outcome,
    message_of,
)

PROMPT_WORDS = 1200  # about 8 s of prefill, in chunks of 8, on the 51.7M Llama
CUT_AFTER_S = 1.0  # after the engine took the request: some chunks computed, not all
EMBED_INPUTS = [f"input number {i} " + "paged attention " * 10 for i in range(2048)]
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def long_prompt(shift: int) -> str:
    """A prompt of PROMPT_WORDS words, one token each; `shift` makes each case's own, so
    that none finds another's blocks cached."""
    return " ".join(WORDS[(shift + i * 7) % len(WORDS)] for i in range(PROMPT_WORDS))


def hangup_calls(prompt: str, max_tokens: int) -> dict[str, tuple[str, dict]]:
    """Each API's request for `prompt` (path, body)."""
    messages = [{"role": "user", "content": prompt}]
    return {
        "chat, streamed": (
            "/v1/chat/completions",
            {"model": TINY, "messages": messages, "max_tokens": max_tokens, "stream": True},
        ),
        "Messages, streamed": (
            "/v1/messages",
            {"model": TINY, "messages": messages, "max_tokens": max_tokens, "stream": True},
        ),
        "Responses": (
            "/v1/responses",
            {"model": TINY, "input": prompt, "max_output_tokens": max_tokens},
        ),
    }


def hang_up(gw: Gateway, path: str, body: dict, key: str, backend: str) -> None:
    """Send the request on a socket of its own, and close it CUT_AFTER_S after the
    engine has taken it (its /admin/backends row shows it running or waiting)."""
    data = json.dumps(body).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nx-api-key: {key}\r\nanthropic-version: 2023-06-01\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + data)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            row = gw.backend(backend)
            if row["running"] + row["waiting"]:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"{backend} never showed the request running")
        time.sleep(CUT_AFTER_S)


def prefill_hangups(gw: Gateway) -> list[Outcome]:
    """Item 1 on each API: billed prompt tokens of the cut request; cached tokens of the
    same request sent again whole (work the first one left in the cache)."""
    out = []
    for shift, api in enumerate(hangup_calls("", 0)):
        label = f"hangup-{shift}"
        key = gw.tenant(label)
        prompt = long_prompt(shift)
        path, body = hangup_calls(prompt, 32)[api]
        hang_up(gw, path, body, key, TINY)
        (cut,) = gw.wait_rows(label, 1)
        _, again = hangup_calls(prompt, 1)[api]
        whole = gw.post(path, again | {"stream": False}, key)
        rows = gw.wait_rows(label, 2)
        if whole.status_code != 200 or len(rows) < 2:
            out.append(Outcome(1, f"hang-up in prefill: {api}", False, "the repeat failed"))
            continue
        billed, total, cached = (
            cut["prompt_tokens"],
            rows[1]["prompt_tokens"],
            rows[1]["cached_tokens"],
        )
        figure = (
            f"{cut['status']}, billed {billed} of {total} prompt tokens; "
            f"sent again: {cached} cached"
        )
        ok = cut["status"] == 499 and billed > 0 and cached <= billed
        out.append(Outcome(1, f"hang-up in prefill: {api}", ok, figure))
    return out


def embedding_hangup(gw: Gateway) -> Outcome:
    """Item 1 on embeddings: 2048 inputs, cut after a second of pooling."""
    key = gw.tenant("hangup-embed")
    body = {"model": EMBED, "input": EMBED_INPUTS}
    hang_up(gw, "/v1/embeddings", body, key, EMBED)
    (cut,) = gw.wait_rows("hangup-embed", 1)
    whole = gw.post("/v1/embeddings", body, key).json()["usage"]["prompt_tokens"]
    billed = cut["prompt_tokens"]
    figure = f"{cut['status']}, billed {billed} of {whole} tokens"
    return Outcome(1, "hang-up while embedding", cut["status"] == 499 and billed > 0, figure)


def adapter_deleted_midway(gw: Gateway) -> Outcome:
    """Item 2: an adapter of the fake model (priced 2 $/M in, 4 $/M out) deleted after the
    first chunk of its 20-token stream; its row's spend against the admitted price."""
    path = gw.workdir / "sql-lora"
    path.mkdir(exist_ok=True)
    body = {"name": "sql-lora", "path": str(path), "base_model": FAKE}
    assert gw.post("/admin/adapters", body).status_code == 201
    key = gw.tenant("adapter-price")
    chat = {"model": "sql-lora", "messages": [{"role": "user", "content": "hello there"}]}
    chat |= {"max_tokens": 20, "stream": True}
    deleted = None
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=chat, headers=headers) as r:
        for line in r.iter_lines():
            if deleted is None and line.startswith("data: {"):
                gone = httpx.delete(
                    gw.url + "/admin/adapters/sql-lora",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                )
                deleted = gone.status_code
    (row,) = gw.wait_rows("adapter-price", 1)
    due = 2000 * row["prompt_tokens"] + 4000 * row["completion_tokens"]  # nanodollars
    figure = (
        f"{row['status']}, {row['completion_tokens']} tokens; spend {row['spend_nano_usd']} n$ "
        f"(priced when admitted: {due} n$)"
    )
    ok = row["status"] == 200 and deleted == 200 and row["spend_nano_usd"] == due > 0
    return Outcome(2, "adapter deleted mid-stream", ok, figure)


def _describe(answer: httpx.Response) -> str:
    """Status and what a client makes of it: an error's code or type and whether it names
    the adapter; a success's stop reason and length of text."""
    data = (
        answer.json()
        if answer.headers.get("content-type", "").startswith("application/json")
        else {}
    )
    if answer.status_code >= 400:
        error = data.get("error", {})
        named = "names it" if "'broken'" in message_of(answer) else "does not name it"
        return f"{answer.status_code} {error.get('code') or error.get('type')}, {named}"
    if "choices" in data:
        choice = data["choices"][0]
        text = choice["message"]["content"] or ""
        return f"200 finish {choice['finish_reason']}, {len(text)} chars"
    text = "".join(b.get("text", "") for b in data.get("content", []))
    return f"200 {data.get('stop_reason')}, {len(text)} chars"


def adapter_broken_later(gw: Gateway, adapter: str) -> Outcome:
    """Item 3: a good PEFT adapter of the `tiny` engine registered, then its weights file
    cut to half (as a copy that died half-way leaves it); chat, then Messages, under it."""
    broken = gw.workdir / "broken"
    shutil.rmtree(broken, ignore_errors=True)
    shutil.copytree(adapter, broken)
    status = gw.post("/admin/adapters", {"name": "broken", "path": str(broken), "base_model": TINY})
    if status.status_code != 201:
        return Outcome(3, "adapter files cut after registration", False, "registration refused")
    weights = Path(broken) / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    key = gw.tenant("broken-adapter")
    messages = [{"role": "user", "content": "paged attention keeps keys in blocks"}]
    body = {"model": "broken", "messages": messages, "max_tokens": 4}
    chat = gw.post("/v1/chat/completions", body, key)
    claude = gw.post("/v1/messages", body, key)
    rows = gw.wait_rows("broken-adapter", 2)
    billed = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    (listed,) = [a for a in gw.admin_get("/admin/adapters")["data"] if a["name"] == "broken"]
    state = listed.get("state", "not shown")
    figure = (
        f"chat {_describe(chat)}; Messages {_describe(claude)}; rows bill {billed} tokens; "
        f"admin: {state}"
    )
    ok = (
        chat.status_code == claude.status_code == 500
        and chat.json()["error"].get("code") == "adapter_load_failed"
        and claude.json().get("type") == "error"
        and billed == 0
        and state == "failed"
    )
    return Outcome(3, "adapter files cut after registration", ok, figure)
