"""`kvgate adapters add|list|delete`: LoRA adapters of a running gateway, through its admin
API (an adapter is checked by the engines serving its base model, so only a running
gateway can register one)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from gateway.cli.output import print_rows


def add_commands(sub: argparse._SubParsersAction) -> None:
    adapters = sub.add_parser("adapters", help="register, list and delete LoRA adapters")
    a_sub = adapters.add_subparsers(dest="adapters_command", required=True)
    add = a_sub.add_parser("add", help="register an adapter (the base model's replicas check it)")
    add.add_argument("name", help="the model id clients will send")
    add.add_argument("path", help="a PEFT directory (gpu), a GGUF LoRA file (local)")
    add.add_argument("--base-model", required=True, help="the served model it adapts")
    add.add_argument("--tenant", help="the tenant (id or name) that alone may use it")
    a_sub.add_parser("list", help="list the adapters")
    delete = a_sub.add_parser("delete", help="delete an adapter (its requests in flight finish)")
    delete.add_argument("name")
    for p in a_sub.choices.values():
        p.add_argument("--url", default="http://127.0.0.1:8000", help="default %(default)s")
        p.add_argument(
            "--key",
            default=os.environ.get("KVGATE_ADMIN_KEY"),
            help="an admin key (default $KVGATE_ADMIN_KEY)",
        )


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    # here, not at the top: every `kvgate` command builds this module's parser, and
    # importing aiohttp costs a command that talks to no gateway about 0.25 CPU-s
    import aiohttp

    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    url = args.url.rstrip("/") + "/admin/adapters"
    try:
        async with aiohttp.ClientSession(headers=headers) as http:
            if args.adapters_command == "add":
                body = {"name": args.name, "path": args.path, "base_model": args.base_model}
                request = http.post(url, json=body | {"tenant": args.tenant})
            elif args.adapters_command == "delete":
                request = http.delete(f"{url}/{args.name}")
            else:
                request = http.get(url)
            async with request as r:
                status, reply = r.status, await r.json()
    except aiohttp.ClientError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 1
    if status >= 300:
        print(f"kvgate: {status}: {reply['error']['message']}", file=sys.stderr)
        return 1
    rows: Any = reply["data"] if args.adapters_command == "list" else reply
    print_rows(rows, args.json)  # the admin commands' tables
    return 0
