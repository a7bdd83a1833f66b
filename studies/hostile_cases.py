"""Part 1 of `python -m studies.hostile`: a catalogue of hostile and careless requests.

Each case is a request (or a short sequence) that a careless client or an attacker
might send, named and grouped by kind, with the answers a correct gateway may give:
an OpenAI-shaped 4xx, a 200 where the input is odd but harmless, or (for a request
that never finishes) closing the connection. Issue 13's reproductions are all here.
"""

from __future__ import annotations

import json
from functools import partial

from studies.hostile_http import (
    CHAT,
    MODEL,
    Case,
    Ctx,
    Reply,
    Send,
    call,
    chat,
    chat_text,
    on_tenant,
    post,
    raw,
    raw_http,
    request,
    user_chat,
)

COMP, PINS = "/v1/completions", "/v1/prefixes"


async def tenant_then_chat(ctx: Ctx, name: str, quota_json: str) -> Reply:
    """Create a tenant with a quota given as raw JSON text; if made, use it once."""
    made = await request(
        ctx,
        "POST",
        "/admin/tenants",
        auth="admin",
        data=f'{{"name": "{name}", {quota_json}}}'.encode(),
    )
    if made.status != 201:
        return made
    tenant_id = json.loads(made.body)["id"]
    key = await request(ctx, "POST", f"/admin/tenants/{tenant_id}/keys", {}, auth="admin")
    if key.status != 201:
        key.note = "creating its key failed"
        return key
    used = await request(ctx, "POST", CHAT, chat(), auth="Bearer " + json.loads(key.body)["key"])
    used.note = "made (201), then used once"
    return used


async def pin_after_429(ctx: Ctx) -> Reply:
    """A tenant refused with 429 must not get prefill work through the pins route."""
    seen = []
    for _ in range(3):  # rpm=1: the second request in a minute is refused
        seen.append((await request(ctx, "POST", CHAT, chat(), auth="rpm1")).status)
        if seen[-1] == 429:
            break
    pin = await request(
        ctx, "POST", PINS, {"name": "after-429", "text": "system rule " * 2000}, auth="rpm1"
    )
    pin.note = f"chat answers before it: {seen}"
    return pin


def _non_utf8_authorization(ctx: Ctx) -> bytes:
    body = json.dumps(chat()).encode()
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
        + b"Authorization: Bearer kvg-\xff\xfe\x80\xc3\r\n\r\n"
        + body
    )


def _chunked_bomb(ctx: Ctx) -> bytes:
    step = 64 * 1024
    chunks = (ctx.bomb[i : i + step] for i in range(0, len(ctx.bomb), step))
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    head = f"POST {CHAT} HTTP/1.1\r\nContent-Type: application/json\r\n"
    return raw_http(head + "Content-Encoding: gzip\r\nTransfer-Encoding: chunked", body)(ctx)


def _bomb(auth: str | None) -> Send:
    gz = {"Content-Encoding": "gzip"}
    return lambda ctx: request(ctx, "POST", CHAT, data=ctx.bomb, headers=gz, auth=auth)


def _cases_auth_and_types() -> list[Case]:
    auth, body = partial(Case, "auth"), partial(Case, "body/JSON types")
    return [
        auth("no_key", (401,), post(CHAT, chat(), auth=None)),
        auth("wrong_key", (401,), post(CHAT, chat(), auth="Bearer kvg-" + "x" * 43)),
        auth("basic_scheme", (401,), post(CHAT, chat(), auth="Basic dXNlcjpwYXNz")),
        auth("bearer_10kb", (400, 401, 431), post(CHAT, chat(), auth="Bearer " + "k" * 10_000)),
        auth("non_utf8_authorization", (400, 401), raw(_non_utf8_authorization)),
        auth("admin_key_for_inference", (403,), post(CHAT, chat(), auth="admin")),
        auth("tenant_key_on_admin", (403,), call("GET", "/admin/tenants")),
        auth(
            "other_tenants_usage",
            (404,),
            on_tenant("GET", "/admin/usage?tenant_id={id}", None, auth="other"),
        ),
        auth(
            "other_tenants_keys",
            (404,),
            on_tenant("GET", "/admin/tenants/{id}/keys", None, auth="other"),
        ),
        auth("metrics_without_key", (401,), call("GET", "/metrics", auth=None)),
        auth("metrics_tenant_key", (403,), call("GET", "/metrics")),
        body("empty_body", (400,), post(CHAT, data=b"")),
        body("invalid_json", (400,), post(CHAT, data=b"{not json")),
        body("json_array", (400,), post(CHAT, data=b"[]")),
        body("json_null", (400,), post(CHAT, data=b"null")),
        body("json_string", (400,), post(CHAT, data=b'"hello"')),
        body("messages_string", (400,), post(CHAT, chat(messages="hi"))),
        body("messages_empty", (400,), post(CHAT, chat(messages=[]))),
        body(
            "role_unknown", (400,), post(CHAT, chat(messages=[{"role": "wizard", "content": "x"}]))
        ),
        body("content_number", (400,), post(CHAT, user_chat(5))),
        body(
            "image_content_part",
            (400,),
            post(CHAT, user_chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])),
        ),
        body("max_tokens_negative", (400,), post(CHAT, chat(max_tokens=-1))),
        body("max_tokens_10pow30", (400,), post(CHAT, chat(max_tokens=10**30))),
        body("max_tokens_float", (400,), post(CHAT, chat(max_tokens=1.5))),
        body("n_zero", (400,), post(CHAT, chat(n=0))),
        body("temperature_nan", (400,), post(CHAT, data=chat_text('"temperature": NaN'))),
        body("temperature_string", (400,), post(CHAT, chat(temperature="hot"))),
        body("stream_yes", (200, 400), post(CHAT, chat(stream="yes"))),
        body("stream_options_string", (400,), post(CHAT, chat(stream=True, stream_options="yes"))),
        body("stop_empty_string", (400,), post(CHAT, chat(stop=""))),
        body("seed_2pow70", (200, 400), post(CHAT, chat(seed=2**70))),
        body("logit_bias_nan", (400,), post(CHAT, data=chat_text('"logit_bias": {"5": NaN}'))),
        body("logit_bias_key_1000_digits", (400,), post(CHAT, chat(logit_bias={"9" * 1000: 1}))),
        body(
            "logit_bias_10k_keys",
            (400,),
            post(CHAT, chat(logit_bias=dict.fromkeys(map(str, range(10_000)), 1))),
        ),
        body("logit_bias_list", (400,), post(CHAT, chat(logit_bias=[[5, 1.0]]))),
        body(
            "deep_nesting",
            (400,),
            post(
                CHAT, data=b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            ),
        ),
        body(
            "text_plain_body",
            (400, 415),
            post(CHAT, data=b"please say hello", headers={"Content-Type": "text/plain"}),
        ),
        body(
            "json_as_text_plain",
            (200, 400, 415),
            post(CHAT, data=json.dumps(chat()).encode(), headers={"Content-Type": "text/plain"}),
        ),
        body(
            "prompt_ids_out_of_range",
            (200, 400),
            post(COMP, {"model": MODEL, "prompt": [-1, 2**40], "max_tokens": 2}),
        ),
        body(
            "prompt_nested_empty",
            (400,),
            post(COMP, {"model": MODEL, "prompt": [[]], "max_tokens": 2}),
        ),
    ]


def _cases_sizes_fanout_compression() -> list[Case]:
    sizes, fan, gz = (partial(Case, k) for k in ("sizes", "fan-out", "compression"))
    fanout = {
        "model": MODEL,
        "prompt": [f"prompt {i}" for i in range(500)],
        "n": 128,
        "max_tokens": 16,
    }
    return [
        sizes("user_300_chars", (200, 400), post(CHAT, chat(user="u" * 300))),
        sizes(
            "body_40kb_tpm100",
            (400, 413, 429),
            post(CHAT, user_chat("word " * 8_000), auth="tpm100"),
        ),
        sizes("body_5mb", (413,), post(CHAT, user_chat("x" * 5_000_000))),
        sizes(
            "stop_10000_strings",
            (200, 400),
            post(CHAT, chat(stop=[f"stop{i}" for i in range(10_000)])),
        ),
        sizes(
            "messages_100000",
            (200, 400, 413),
            post(CHAT, chat(messages=[{"role": "user", "content": "x"}] * 100_000)),
        ),
        sizes(
            "content_length_10gb",
            (413,),
            raw(
                raw_http(
                    f"POST {CHAT} HTTP/1.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {10**10}",
                    b"{" + b" " * 1023,
                ),
                slow=True,
            ),
        ),
        fan("fanout_500x128", (400,), post(COMP, fanout)),
        fan("n_128", (200, 400), post(CHAT, chat(n=128, max_tokens=4))),
        fan(
            "prompt_list_10000",
            (200, 400),
            post(COMP, {"model": MODEL, "prompt": ["w"] * 10_000, "max_tokens": 1}),
        ),
        fan(
            "fanout_no_max_tokens_tpm1000",
            (400, 429),
            post(COMP, {"model": MODEL, "prompt": ["a b"] * 16, "n": 16}, auth="tpm1000"),
        ),
        gz("gzip_bomb_with_key", (413,), _bomb("main")),
        gz("gzip_bomb_without_key", (401, 413), _bomb(None)),
        gz("gzip_bomb_chunked", (413,), raw(_chunked_bomb)),
        gz(
            "gzip_header_plain_body",
            (400,),
            post(CHAT, data=json.dumps(chat()).encode(), headers={"Content-Encoding": "gzip"}),
        ),
        gz(
            "unknown_content_encoding",
            (200, 400, 415),
            post(CHAT, data=json.dumps(chat()).encode(), headers={"Content-Encoding": "zz"}),
        ),
    ]


def _cases_parser() -> list[Case]:
    parser = partial(Case, "headers/parser")
    post_head = f"POST {CHAT} HTTP/1.1\r\nContent-Type: application/json"
    many = "\r\n".join(f"X-H{i}: v" for i in range(10_000))
    return [
        parser("bad_request_line", (400,), raw(b"GARBAGE\r\n\r\n")),
        parser(
            "header_100kb",
            (400, 431),
            raw(raw_http("GET /health HTTP/1.1\r\nX-Big: " + "a" * 100_000)),
        ),
        parser("headers_10000", (400, 431), raw(raw_http("GET /health HTTP/1.1\r\n" + many))),
        parser(
            "content_length_and_chunked",
            (400,),
            raw(
                raw_http(
                    post_head + "\r\nContent-Length: 5\r\nTransfer-Encoding: chunked", b"0\r\n\r\n"
                )
            ),
        ),
        parser(
            "two_content_lengths",
            (400,),
            raw(raw_http(post_head + "\r\nContent-Length: 2\r\nContent-Length: 40", b"{}")),
        ),
        parser(
            "negative_content_length",
            (400,),
            raw(raw_http(post_head + "\r\nContent-Length: -1", b"{}")),
        ),
        parser(
            "bad_chunk_size",
            (400,),
            raw(raw_http(post_head + "\r\nTransfer-Encoding: chunked", b"zz\r\nabc\r\n0\r\n\r\n")),
        ),
        parser(
            "control_char_in_header",
            (400, 401),
            raw(
                raw_http("GET /v1/models HTTP/1.1\r\nAuthorization: Bearer kvg-\x01\x7f", auth=None)
            ),
        ),
        parser(
            "half_sent_headers",
            (None, 408),
            raw(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n".encode(), slow=True),
        ),
        parser(
            "half_sent_body",
            (None, 400, 408),
            raw(raw_http(post_head + "\r\nContent-Length: 1000", b'{"model": "fake'), slow=True),
        ),
    ]


def _cases_quota_pins_admin() -> list[Case]:
    quota, pins, admin = (partial(Case, k) for k in ("quotas", "pins", "admin API"))
    return [
        quota(
            "rpm_2pow31",
            (200, 400),
            lambda ctx: tenant_then_chat(ctx, "rpm-2pow31", f'"rpm": {2**31}'),
        ),
        quota(
            "rpm_10pow20",
            (200, 400),
            lambda ctx: tenant_then_chat(ctx, "rpm-10pow20", f'"rpm": {10**20}'),
        ),
        quota(
            "no_max_tokens_tpm1000", (200, 429), post(CHAT, chat(max_tokens=None), auth="tpm1000")
        ),
        quota("pins_after_429", (429,), pin_after_429),
        pins("pin_text_nul", (400,), post(PINS, {"name": "nul", "text": "be\u0000 nice"})),
        pins("pin_name_nul", (400,), post(PINS, {"name": "a\u0000b", "text": "hi"})),
        pins("pin_text_300k", (400, 413), post(PINS, {"name": "big", "text": "a " * 150_000})),
        pins("pin_model_number", (400,), post(PINS, {"name": "m", "text": "hi", "model": 5})),
        pins("pin_with_admin_key", (403,), post(PINS, {"name": "adm", "text": "hi"}, auth="admin")),
        pins(
            "admin_pin_tenant_nul",
            (400, 404),
            post(
                "/admin/prefixes/pins",
                {"tenant": "t\u0000", "name": "x", "text": "hi", "model": MODEL},
                auth="admin",
            ),
        ),
        admin(
            "tenant_name_nul", (400,), post("/admin/tenants", {"name": "a\u0000b"}, auth="admin")
        ),
        admin(
            "tenant_name_10k", (400,), post("/admin/tenants", {"name": "n" * 10_000}, auth="admin")
        ),
        admin(
            "tenant_unknown_field",
            (400,),
            post("/admin/tenants", {"name": "u", "colour": "red"}, auth="admin"),
        ),
        admin(
            "tenant_models_nul",
            (400,),
            post("/admin/tenants", {"name": "mnul", "models": ["fake\u0000"]}, auth="admin"),
        ),
        admin(
            "weight_infinity",
            (400,),
            post("/admin/tenants", data=b'{"name": "w-inf", "weight": Infinity}', auth="admin"),
        ),
        admin(
            "weight_nan",
            (400,),
            post("/admin/tenants", data=b'{"name": "w-nan", "weight": NaN}', auth="admin"),
        ),
        admin(
            "patch_rpm_string", (400,), on_tenant("PATCH", "/admin/tenants/{id}", {"rpm": "lots"})
        ),
        admin(
            "key_expires_in_1e308",
            (201, 400),
            on_tenant("POST", "/admin/tenants/{id}/keys", {"expires_in_s": 1e308}),
        ),
        admin(
            "key_for_missing_tenant",
            (404,),
            post("/admin/tenants/t_missing/keys", {}, auth="admin"),
        ),
        admin(
            "usage_since_garbage", (400,), call("GET", "/admin/usage?since=yesterday", auth="admin")
        ),
    ]


def _cases_urls_unicode() -> list[Case]:
    url, uni = partial(Case, "URLs/control characters"), partial(Case, "unicode")
    return [
        url("user_nul", (200, 400), post(CHAT, chat(user="a\u0000b"))),
        url("path_nul", (400, 404), call("GET", "/v1/models%00")),
        url("query_nul", (400,), call("GET", "/admin/usage?tenant_id=%00", auth="admin")),
        url("tenant_path_nul", (400,), call("GET", "/admin/tenants/%00", auth="admin")),
        url("query_crlf", (400,), call("GET", "/admin/usage?tenant_id=%0d%0aX:%201", auth="admin")),
        url("url_100kb", (400, 414), call("GET", "/v1/models?q=" + "a" * 100_000)),
        url("path_traversal", (400, 401, 404), raw(raw_http("GET /v1/../admin/tenants HTTP/1.1"))),
        url("unknown_route", (404,), call("GET", "/v2/whatever")),
        url("wrong_method", (405,), call("GET", CHAT)),
        uni("model_rtl_override", (404,), post(CHAT, chat(model="fake-model\u202e"))),
        uni("model_nul", (400, 404), post(CHAT, chat(model="fake\u0000model"))),
        uni("emoji_content", (200,), post(CHAT, user_chat("\U0001f600" * 1000))),
        uni("user_lone_surrogate", (200, 400), post(CHAT, data=chat_text('"user": "a\\ud800b"'))),
        uni(
            "content_lone_surrogate",
            (200, 400),
            post(CHAT, data=json.dumps(user_chat("a?b")).replace("?", "\\udc80").encode()),
        ),
        uni(
            "invalid_utf8_body",
            (400,),
            post(CHAT, data=json.dumps(user_chat("?")).encode().replace(b"?", b"\xc0\xaf")),
        ),
        uni(
            "tenant_name_emoji",
            (201,),
            post("/admin/tenants", {"name": "caf\u00e9 \U0001f642"}, auth="admin"),
        ),
    ]


def catalogue() -> list[Case]:
    """Every case, in the order sent."""
    return [
        *_cases_auth_and_types(),
        *_cases_sizes_fanout_compression(),
        *_cases_parser(),
        *_cases_quota_pins_admin(),
        *_cases_urls_unicode(),
    ]
