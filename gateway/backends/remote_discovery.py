"""What a third-party upstream tells about itself, so that a remote entry works from its
URL alone: the model id it serves, its context length and the endpoint that tokenizes
for it. Each server says it in its own place:

- the model id: /v1/models (the entry's `model` if served, else the only model served);
- the context length: vLLM's and SGLang's `max_model_len` in /v1/models, llama.cpp's
  llama-server `/props` (`default_generation_settings.n_ctx`), Ollama's `/api/show`
  (`model_info.<architecture>.context_length`); llama-cpp-python's server tells none;
- a tokenizer: vLLM's `/tokenize` (prompt or chat in, token ids out), llama-server's
  `/tokenize` (`content` in: text only; its `/apply-template` renders a chat first), so
  both get exact quotas; llama-cpp-python's `/extras/tokenize` (`input`) counts output
  only, as it renders chats with a template it does not publish.

The entry's options win over anything found. What is found, and what is assumed where
nothing is, is logged once per upstream (`kvgate serve` prints it at start).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

from engine_api.errors import BackendError, BadRequestError
from gateway.backends.remote_http import UpstreamClient, UpstreamRefused
from gateway.backends.remote_text import MARGIN

log = logging.getLogger("kvgate.remote")

# the context length assumed for an upstream that tells none (options.context_length
# sets it): requests past the real one get the upstream's own context error
ASSUMED_CONTEXT_LENGTH = 8192
PROBE_MAX_BYTES = 1 << 20  # a probe's answer (llama-server's /props carries its template)
VLLM, LLAMA_SERVER, LLAMA_CPP_PYTHON = "/tokenize", "/tokenize (llama-server)", "/extras/tokenize"


@dataclass(frozen=True)
class Found:
    """What probing an upstream found; None where it told nothing."""

    context_length: int | None = None
    context_from: str = ""  # where the context length was read
    tokenizer: str | None = None  # VLLM, LLAMA_SERVER or LLAMA_CPP_PYTHON
    # tokens its tokenizer adds to any text (llama-cpp-python's /extras/tokenize adds
    # BOS and has no switch for it): taken off a count of generated text
    count_overhead: int = 0


def pick_entry(entries: list[Any], wanted: str | None, default: str, label: str) -> dict:
    """The /v1/models entry of the model to use: `wanted` (options.upstream_model), else
    `default` (the entry's model) if served, else the only model served."""
    served = [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]
    match = [e for e in served if e["id"] == (wanted or default)]
    if match:
        return match[0]
    if wanted is None and len(served) == 1:
        return served[0]
    why = "it serves " + (", ".join(repr(e["id"]) for e in served) or "none")
    if wanted is None and served:
        why += "; set options.upstream_model to one of them"
    raise UpstreamRefused(f"{label}: the upstream does not serve {wanted or default!r} ({why})")


def positive_int(n: Any) -> int | None:
    """`n` if JSON gave a positive integer (not a bool), else None."""
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


async def probe(
    client: UpstreamClient, model: str, timeout_s: float, context: bool, tokenizer: bool
) -> Found:
    """What a third-party upstream serving `model` tells, from whichever of the known
    endpoints answer: its context length if `context`, its tokenizer if `tokenizer`
    (what is known already is not asked again: the first health check waits on this)."""

    async def ask(method: str, path: str, body: Any = None) -> dict | None:
        """Its JSON answer, or None: a refusal only says it is not this kind of server
        (so it is not logged as a failure)."""
        try:
            url = client.endpoint.root + path
            async with await client.request(method, url, body, timeout_s=timeout_s) as resp:
                if resp.status != 200:
                    return None
                data = json.loads(await client.read(resp, PROBE_MAX_BYTES))
        except (BackendError, BadRequestError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    found = Found()
    if tokenizer and _tokens(await ask("POST", "/tokenize", {"model": model, "prompt": "hi"})):
        found, tokenizer = Found(tokenizer=VLLM), False
    props = await ask("GET", "/props") if context or tokenizer else None
    if props is not None:  # llama.cpp's llama-server
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else props.get("n_ctx")
        if context and (length := positive_int(n_ctx)) is not None:
            found = dataclasses.replace(found, context_length=length, context_from="/props n_ctx")
            context = False
        if tokenizer and _tokens(await ask("POST", "/tokenize", {"content": "hi"})):
            found, tokenizer = dataclasses.replace(found, tokenizer=LLAMA_SERVER), False
    if context and (show := await ask("POST", "/api/show", {"model": model})):  # Ollama
        info = show.get("model_info")
        for key, value in info.items() if isinstance(info, dict) else ():
            if key.endswith(".context_length") and (length := positive_int(value)):
                found = dataclasses.replace(
                    found, context_length=length, context_from=f"/api/show {key}"
                )
                break
    if tokenizer and _tokens(await ask("POST", "/extras/tokenize", {"input": "hi"})):
        empty = await ask("POST", "/extras/tokenize", {"input": ""})
        tokens = empty.get("tokens") if empty else None
        overhead = len(tokens) if isinstance(tokens, list) else 0
        found = dataclasses.replace(found, tokenizer=LLAMA_CPP_PYTHON, count_overhead=overhead)
    return found


def _tokens(data: dict | None) -> list[int] | None:
    """The token ids of a tokenize answer (every server above says `tokens`)."""
    tokens = data.get("tokens") if data else None
    ok = isinstance(tokens, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    )
    return tokens if ok and tokens else None


def announce(name: str, model: str, found: Found, configured: dict[str, Any]) -> None:
    """One line per upstream: what was discovered, what was configured, what assumed."""
    length = configured.get("context_length")
    if length is not None:
        context = f"context length {length} (configured)"
    elif found.context_length is not None:
        context = f"context length {found.context_length} (from {found.context_from})"
    else:
        context = f"context length {ASSUMED_CONTEXT_LENGTH} (assumed: the upstream tells none)"
    if configured.get("tokenizer"):
        tokens = f"tokenizer {configured['tokenizer']!r} (configured)"
    elif found.tokenizer in (VLLM, LLAMA_SERVER):
        tokens = "tokenizer: the upstream's /tokenize (exact quotas)"
    else:
        what = "no tokenizer"
        if found.tokenizer:  # llama-cpp-python's: its chat template is its own
            what = f"no chat rendering; output counted by its {found.tokenizer}"
        tokens = (
            f"{what}: quotas reserved from the prompt's UTF-8 bytes + {MARGIN}, settled "
            "from the upstream's usage"
        )
    source = "configured" if configured.get("upstream_model") else "discovered"
    log.info("%s: model %r (%s), %s, %s", name, model, source, context, tokens)
