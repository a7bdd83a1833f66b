"""A remote entry's options: one replica's settings, checked with a message naming the
first bad one, and `options.urls` split into one spec per replica. Kept apart from the
adapter (remote.py) so the settings and their defaults read in one place.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from gateway.backends.common import check_options
from gateway.backends.kv_transfer import check_role
from gateway.backends.remote_http import MAX_RESPONSE_BYTES, Endpoint
from gateway.backends.spec import BackendSpec


@dataclass(frozen=True)
class RemoteOptions:
    """One replica's options (`urls` already split into one `url` each), each winning
    over what the upstream tells at start: api_key (a worker's token, or a third-party
    server's key), upstream_model (default: the entry's `model` if the upstream serves
    it, else the one model it serves), context_length (else the upstream's, else
    assumed), tokenizer (an HF tokenizer directory or a GGUF file: exact quotas for an
    upstream that cannot render chats into token ids for the gateway), read_timeout_s
    (between bytes), first_token_timeout_s (from sending a request to its first output),
    request_timeout_s (a whole request), max_response_bytes (a stream or an answer),
    start_timeout_s (how long `start` waits for the upstream to tell what it is, or with
    context_length set for its first health check; one that does not answer is down
    until it does), max_in_flight (plus, under VTC, one spare for a tenant with nothing
    in flight)."""

    url: str
    api_key: str | None = None
    # the name of an environment variable that holds api_key, so that the config file
    # holds no secret (a Kubernetes Secret, a compose variable)
    api_key_env: str | None = None
    upstream_model: str | None = None
    context_length: int | None = None
    tokenizer: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    # a trickle of bytes keeps the read timeout from firing: these bound the waits whole
    first_token_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0
    max_response_bytes: int = MAX_RESPONSE_BYTES
    health_interval_s: float = 2.0
    start_timeout_s: float = 30.0
    # requests this gateway lets in flight at once; past it they wait in the gateway's
    # fair queue (for an upstream that serves in arrival order)
    max_in_flight: int | None = None
    # "embed": the upstream's model is an embedding model (remote_embed.py)
    task: str | None = None
    # prefill | decode | both (gateway.backends.kv_transfer); None: what a kvgate
    # worker's /v1/models says, else both
    role: str | None = None
    # a third-party upstream's model takes images (vLLM's and SGLang's vision models):
    # they go to its /v1/chat/completions as data URLs (remote_vision.py); a kvgate
    # worker's /v1/models says so itself
    vision: bool = False
    # the most prompt tokens one image may count on such an upstream: reserved for each
    # image before admission, and the most its usage may bill for one
    image_tokens: int = 4096

    @classmethod
    def parse(cls, spec: BackendSpec) -> RemoteOptions:
        """The entry's options, or ValueError naming the first bad one."""
        check_options(spec, [f.name for f in dataclasses.fields(cls)])
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in spec.options:
                continue
            v = spec.options[f.name]
            if f.name.endswith("_s"):
                ok = isinstance(v, int | float) and not isinstance(v, bool) and v > 0
                rule = "a number of seconds > 0"
            elif f.name == "vision":
                ok, rule = isinstance(v, bool), "true or false"
            elif f.name in (
                "context_length",
                "max_in_flight",
                "max_response_bytes",
                "image_tokens",
            ):
                ok, rule = (
                    isinstance(v, int) and not isinstance(v, bool) and v > 0,
                    "an integer > 0",
                )
            else:
                ok, rule = isinstance(v, str) and v != "", "a non-empty string"
            if not ok:
                raise ValueError(
                    f"remote backend {spec.name!r}: {f.name} must be {rule}, got {v!r}"
                )
            values[f.name] = v
        if "role" in values:
            check_role(values["role"], f"remote backend {spec.name!r}")
        if "image_tokens" in values and not values.get("vision"):  # else it bounds nothing
            raise ValueError(f"remote backend {spec.name!r}: image_tokens goes with vision = true")
        if "api_key_env" in values:
            values["api_key"] = _key_from_env(spec.name, values)
        if "url" not in values:
            raise ValueError(f"remote backend {spec.name!r} needs options.url or options.urls")
        return cls(**values)


def _key_from_env(name: str, values: dict[str, Any]) -> str:
    if "api_key" in values:
        raise ValueError(f"remote backend {name!r}: give api_key or api_key_env, not both")
    key = os.environ.get(values["api_key_env"])
    if not key:
        raise ValueError(
            f"remote backend {name!r}: api_key_env names {values['api_key_env']}, which is not set"
        )
    return key


def replica_specs(spec: BackendSpec) -> list[BackendSpec]:
    """One spec per upstream: `options.urls` gives a replica per URL, like `replicas`
    in-process; `options.url` gives one."""
    options = dict(spec.options)
    if "replicas" in options:
        raise ValueError(f"remote backend {spec.name!r}: list options.urls, not replicas")
    if ("url" in options) == ("urls" in options):
        raise ValueError(f"remote backend {spec.name!r} needs one of options.url, options.urls")
    urls = [options.pop("url")] if "url" in options else options.pop("urls")
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
        raise ValueError(f"remote backend {spec.name!r}: urls must be a list of URLs")
    addresses = [(e.host, e.port) for e in map(Endpoint.parse, urls)]
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"remote backend {spec.name!r}: urls name one host:port twice")
    return [dataclasses.replace(spec, options=options | {"url": u}) for u in urls]
