"""The settings table of the docs (docs/reference/configuration.md), generated at every
`make docs` from gateway.config's Settings, gateway.config_load's KVGATE_* variables and
`kvgate serve`'s flags: a setting's flag says what it does (its help); a setting with no
flag says it here, in FLAGLESS. A setting with neither, or a flag of `kvgate serve` that sets no
setting, fails the build, so the table cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from gateway.config import Settings
from gateway.config_load import _ENV_FIELDS
from tools.reference_cli import _subcommands

# the settings `kvgate serve` takes no flag for: what each sets
FLAGLESS = {
    "sqlite_wal_limit_bytes": "SQLite: the write-ahead log's size past which the usage "
    "writer checkpoints it and starts it again",
    "instance": "names this gateway's prefix-catalog rows, so that gateways sharing one "
    "database keep theirs apart; keep it across restarts (default `<hostname>:<port>`)",
    "secret": "the HMAC secret of the tenants' cache salts (default: generated and stored "
    "in the database)",
    "kv_tier_secret": "the key of the MAC on the KV blocks the engines store (disk, Redis) "
    "or move between workers; at least 32 characters (default: generated into the "
    "database, shared by its gateways). Never an engine option",
    "max_body_bytes": "request body limit, also once decompressed",
    "key_cache_ttl_s": "seconds a key lookup is cached; changes made through kvgate (admin "
    "API, `kvgate keys`/`tenants`) reach it within 0.1 s anyway, other edits of the "
    "database within this",
    "metrics_auth": "`/metrics` needs the admin key or the metrics token (`1`, `true`, "
    "`yes`; anything else: open to anyone who can reach the port)",
    "metrics_token": "a token for a Prometheus scraper (32+ characters)",
    "max_connections": "past it a connection gets a 503 and is closed",
    "header_timeout_s": "seconds to send complete headers; then the connection is closed",
    "body_timeout_s": "seconds to send a body; then 408",
    "keepalive_timeout_s": "an idle kept-alive connection is closed after it",
    "max_pins_per_tenant": "pinned prefixes per tenant",
    "max_pin_tokens_per_tenant": "tokens of a tenant's pinned prefixes",
    "prefill_timeout_s": "a prefill job's bound; past it the decode worker computes the "
    "prompt itself",
    "files_dir": "the directory of the Files API's files (made 0700); empty: `kvgate-files` "
    "beside a SQLite database, else in the working directory",
    "max_file_bytes": "the largest file `POST /v1/files` takes",
    "max_file_lines": "the most lines a batch input file may have",
    "batch_in_flight": "batch lines run at once at most (each only while nothing waits)",
    "max_image_bytes": "an image's bytes as sent (decoded from base64) or fetched; past "
    "it a 400 naming this limit",
    "max_image_pixels": "an image's width x height, read from its header before it is "
    "decoded; past it a 400",
    "max_images_per_request": "images in one request's messages; past it a 400",
    "allowed_image_hosts": "the hosts whose `https://` or `http://` image URLs the gateway "
    "fetches (names, no scheme or port; the variable: separated by spaces or commas). "
    "Every address a host resolves to must be public (not private, loopback or "
    "link-local), redirects are not followed. Empty: image URLs are a 400, images come "
    "inline (data URLs, base64)",
    "image_fetch_timeout_s": "seconds to fetch one image from an allowed host, all of it",
}
# Settings fields that are tables of the file, not scalar settings (the page's prose)
TABLES = {"backends", "prices", "batch_prices"}
# `kvgate serve` flags that are no setting
NOT_SETTINGS = {"help", "verbose", "config", "json"}


def _flags() -> tuple[dict[str, argparse.Action], dict[str, str]]:
    """`kvgate serve`'s flags (and the global ones) by the setting each sets, and the
    title of each one's argument group (the backend its engine setting is for)."""
    from gateway.cli.main import build_parser

    parser = build_parser()
    serve = dict(_subcommands(parser))["serve"]
    groups = {
        id(action): group.title or ""
        for group in serve._action_groups
        if group.title not in ("options", "positional arguments")
        for action in group._group_actions
    }
    by_setting: dict[str, argparse.Action] = {}
    group_of: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(Settings)}
    for action in [*parser._actions, *serve._actions]:
        if not action.option_strings or action.dest in NOT_SETTINGS:
            continue
        setting = next((n for n in (action.dest, f"{action.dest}_s") if n in names), None)
        if setting is None:
            raise RuntimeError(f"kvgate serve {action.option_strings[0]} sets no setting")
        by_setting[setting] = action
        group_of[setting] = groups.get(id(action), "")
    return by_setting, group_of


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {"default": action.default, "prog": "kvgate serve"}
    return text


def _default(field: dataclasses.Field) -> str:
    if field.default is dataclasses.MISSING:
        return ""
    value: Any = field.default
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


HEAD = "| `[server]` key | Variable | Flag | Default | What it sets |\n|---|---|---|---|---|"


def settings_table() -> str:
    """Markdown: a table of the gateway's settings, then one per group of engine
    settings (under its title), each in the order Settings declares them."""
    flags, group_of = _flags()
    fields = [f for f in dataclasses.fields(Settings) if f.name not in TABLES]
    tables: dict[str, list[str]] = {"": [HEAD]}
    for field in fields:
        action = flags.get(field.name)
        if action is not None:
            what = _help(action)
        elif field.name in FLAGLESS:
            what = FLAGLESS[field.name]
        else:
            raise RuntimeError(
                f"setting {field.name!r} has no flag and no description: describe it in "
                "FLAGLESS (tools/reference_config.py)"
            )
        variable = f"`KVGATE_{field.name.upper()}`" if field.name in _ENV_FIELDS else ""
        flag = f"`{action.option_strings[0]}`" if action is not None else ""
        cells = (f"`{field.name}`", variable, flag, _default(field), _cell(what))
        rows = tables.setdefault(group_of.get(field.name, ""), [HEAD])
        rows.append("| " + " | ".join(cells) + " |")
    parts = []
    for title, rows in tables.items():
        if title:
            parts.append(f"\nSettings of the {title}:\n")
        parts.append("\n".join(rows))
    return "\n".join(parts) + "\n"
