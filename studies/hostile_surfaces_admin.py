"""Issue 45's admin-input and error-text items as `python -m studies.hostile_surfaces`
tries them, from outside the gateway:

6. a reload of a config a careless admin wrote (a price of 1e300, a string where a
   number belongs, no [[backends]]): the reload's answer, then whether the gateway serves
   and bills as before;
7. adapters whose files are corrupt (random bytes, cut short) or whose
   adapter_config.json is huge: the registration's answer, and /health's latency while
   the huge one is read;
8. embedding inputs of token ids of the wrong type or range: whether the 400's message
   shows implementation details (pydantic's labels, Python reprs, addresses);
9. /tokenize and count_tokens from a tenant already refused with 429 for rpm.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx

from studies.hostile_load import Prober, window_stats
from studies.hostile_surfaces_setup import (
    FAKE,
    FAKE_EMBED,
    TINY,
    Gateway,
    Outcome,
    fake_config,
    message_of,
    peak_rss_mib,
    reset_peak_rss,
    short,
)

# what a message about the API's fields must not show: pydantic's validator and union
# labels, a functools.partial's repr, a memory address, Python's type names
INTERNALS = re.compile(
    r"function-(after|before|wrap|plain)|functools|partial\(|0x[0-9a-f]{6,}|pydantic"
    r"|json-or-python|lax-or-strict|tagged-union|union\[|list\[|\[int\]|constrained-"
)
BAD_TOKEN_INPUTS = {
    "a string among ids": [[1, "a"]],
    "a float among ids": [1.5, 2],
    "a negative id": [[-1, 5]],
    "an id of 2**40": [[2**40]],
}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _chat_spend(gw: Gateway, label: str) -> str:
    """A chat's status and its row's spend against the fake model's price (2 and 4 $/M)."""
    key = gw.tenant(label)
    body = {"model": FAKE, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    answer = gw.post("/v1/chat/completions", body, key)
    if answer.status_code != 200:
        return f"chat {answer.status_code}"
    (row,) = gw.wait_rows(label, 1)
    due = 2000 * row["prompt_tokens"] + 4000 * row["completion_tokens"]
    return "chat 200, billed as before" if row["spend_nano_usd"] == due else "chat 200, mispriced"


def _reload(gw: Gateway, config: str) -> httpx.Response:
    gw.config_file.write_text(config)
    return gw.post("/admin/reload", {})


def _models(gw: Gateway) -> list[str]:
    listed = gw.get("/v1/models", gw.tenant("models")).json()
    return sorted(m["id"] for m in listed["data"])


def reloads(gw: Gateway) -> list[Outcome]:
    """Item 6, on the fake gateway: each bad config reloaded, then a chat; the good
    config put back (and reloaded where the bad one was taken)."""
    good = fake_config()
    bad = {
        "price 1e300": good.replace("input = 2.0", "input = 1e300"),
        'drain_timeout_s = "abc"': '[server]\ndrain_timeout_s = "abc"\n' + good,
        "no [[backends]]": good[good.index("[prices.") :],
    }
    models = _models(gw)
    out = []
    for n, (name, config) in enumerate(bad.items()):
        answer = _reload(gw, config)
        error = answer.json().get("error", {}) if answer.status_code >= 400 else {}
        said = f"reload {answer.status_code}"
        if error:
            said += f" {error.get('code')} ({error.get('param') or short(error['message'], 70)})"
        serving = _chat_spend(gw, f"reload-{n}")
        same = _models(gw) == models
        out.append(
            Outcome(
                6,
                f"reload: {name}",
                answer.status_code == 400
                and error.get("code") == "invalid_config"
                and serving == "chat 200, billed as before"
                and same,
                f"{said}; then {serving}, models {'as before' if same else 'changed'}",
            )
        )
        gw.config_file.write_text(good)
        if answer.status_code == 200:
            _reload(gw, good)
    return out


def _adapter_copies(good: str, workdir: Path, huge_mib: int) -> dict[str, tuple[Path, str]]:
    """Broken copies of a good adapter and the file each breaks."""
    made = {}
    for name, file in [
        ("random bytes", ADAPTER_WEIGHTS),
        ("cut short", ADAPTER_WEIGHTS),
        (f"{huge_mib} MiB config", ADAPTER_CONFIG),
    ]:
        where = workdir / "adapters" / name.replace(" ", "-")
        shutil.rmtree(where, ignore_errors=True)
        shutil.copytree(good, where)
        made[name] = (where, file)
    noise, short_cut = made["random bytes"][0], made["cut short"][0]
    (noise / ADAPTER_WEIGHTS).write_bytes(os.urandom(4096))
    data = (short_cut / ADAPTER_WEIGHTS).read_bytes()
    (short_cut / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])
    huge = made[f"{huge_mib} MiB config"][0] / ADAPTER_CONFIG
    config = json.loads(huge.read_text())
    with huge.open("w") as f:  # valid JSON: a note of huge_mib MiB beside the real keys
        f.write(json.dumps(config)[:-1] + ', "notes": "')
        for _ in range(huge_mib):
            f.write("x" * (1 << 20))
        f.write('"}')
    return made


def corrupt_adapters(gw: Gateway, good: str, huge_mib: int) -> list[Outcome]:
    """Item 7, on the `tiny` engine: each broken copy registered while /health is probed
    every 5 ms; its answer, how long it took, /health's worst latency meanwhile and the
    gateway's peak memory growth."""
    out = []
    for name, (path, file) in _adapter_copies(good, gw.workdir, huge_mib).items():
        rss = reset_peak_rss(gw.pid)
        prober = Prober(gw.url, 0.005)
        start = time.monotonic()
        try:
            body = {"name": path.name, "path": str(path), "base_model": TINY}
            answer = gw.post("/admin/adapters", body)
        finally:
            end = time.monotonic()
            samples = prober.stop()
        health = window_stats(samples, start, end)
        named = file in message_of(answer)
        figure = (
            f"{answer.status_code} {'naming' if named else 'not naming'} {file} in "
            f"{end - start:.1f} s; /health max {health['max_ms'] or 0:.0f} ms; "
            f"peak RSS +{max(peak_rss_mib(gw.pid) - rss, 0):.0f} MiB"
        )
        ok = answer.status_code == 400 and named
        out.append(Outcome(7, f"register adapter: {name}", ok, figure))
    return out


def token_id_errors(gw: Gateway) -> list[Outcome]:
    """Item 8, on the fake embedder: each bad input's status and message."""
    key = gw.tenant("validation")
    out = []
    for name, value in BAD_TOKEN_INPUTS.items():
        answer = gw.post("/v1/embeddings", {"model": FAKE_EMBED, "input": value}, key)
        message = message_of(answer)
        leaks = list(dict.fromkeys(m.group(0) for m in INTERNALS.finditer(message)))
        figure = f"{answer.status_code}: {short(message, 70)}"
        if leaks:
            more = f" and {len(leaks) - 3} more" if len(leaks) > 3 else ""
            figure = f"{answer.status_code}, shows {', '.join(map(repr, leaks[:3]))}{more}"
        ok = answer.status_code == 400 and not leaks
        out.append(Outcome(8, f"embeddings input: {name}", ok, figure))
    return out


def counted_after_429(gw: Gateway) -> Outcome:
    """Item 9: a tenant of 1 request a minute sends chats until one is refused, then
    /tokenize and count_tokens, each with a 1 MB body."""
    if time.time() % 60 > 50:  # all of it within one rate minute
        time.sleep(61 - time.time() % 60)
    key = gw.tenant("rpm1", rpm=1)
    chat = {"model": FAKE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    seen = [gw.post("/v1/chat/completions", chat, key).status_code for _ in range(2)]
    text = "word " * 200_000
    tokenize = gw.post("/tokenize", {"model": FAKE, "prompt": text}, key)
    messages = [{"role": "user", "content": text}]
    count = httpx.post(
        gw.url + "/v1/messages/count_tokens",
        json={"model": FAKE, "messages": messages},
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    figure = (
        f"chats {seen[0]}, {seen[1]}; then /tokenize {tokenize.status_code}, "
        f"count_tokens {count.status_code}"
    )
    ok = seen[-1] == 429 and tokenize.status_code == count.status_code == 429
    return Outcome(9, "/tokenize and count_tokens after a 429", ok, figure)
