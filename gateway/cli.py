"""The `kvgate` command."""

from __future__ import annotations

import argparse
import sys

from gateway import cli_admin
from gateway.config import load_settings
from gateway.worker import cli as worker_cli

_DELEGATED = {"top": "tui.cli", "bench": "bench.cli"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    parser.add_argument("--config", help="TOML config file (or KVGATE_CONFIG)")
    parser.add_argument("--database-url", help="e.g. sqlite+aiosqlite:///kvgate.db")
    parser.add_argument("--database-schema", help="PostgreSQL schema (search_path)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--backend", choices=["auto", "fake", "gpu", "local"])
    serve.add_argument("--model", help="GGUF file or HF directory (default: Gemma 3 270M)")
    serve.add_argument("--served-model-name")
    serve.add_argument("--admin-key", help="bootstrap admin key (or KVGATE_ADMIN_KEY)")
    serve.add_argument("--replicas", type=int, help="engine replicas of --backend (default 1)")
    serve.add_argument(
        "--workers",
        type=int,
        help="run each engine as N `kvgate worker` processes (one per GPU, or the cores split)",
    )
    serve.add_argument(
        "--router-policy",
        help="prefix (default: where the prompt's prefix is cached), round_robin, least_loaded",
    )
    serve.add_argument(
        "--quantization", choices=["fp8", "int8"], help="gpu backend: 8-bit weights, made at load"
    )
    serve.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8"], help="gpu backend: fp8 holds twice the blocks"
    )
    serve.add_argument(
        "--fairness",
        choices=["vtc", "fcfs"],
        help="how tenants share a backend: vtc (default, the Virtual Token Counter) or fcfs",
    )

    worker_cli.add_parser(sub)
    sub.add_parser("models", help="list the models kvgate can serve and where they live")
    sub.add_parser("top", help="live dashboard of a running gateway", add_help=False)
    sub.add_parser("bench", help="benchmarks against any OpenAI-compatible server", add_help=False)
    cli_admin.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `top` and `bench` own their flags: hand them everything after the subcommand.
    for i, arg in enumerate(argv):
        if arg in _DELEGATED:
            import importlib

            return importlib.import_module(_DELEGATED[arg]).main(argv[i + 1 :])
        if not arg.startswith("-"):
            break
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        return worker_cli.run(args)
    overrides = {
        "database_url": args.database_url,
        "database_schema": args.database_schema,
    }
    if args.command == "serve":
        overrides |= {
            "host": args.host,
            "port": args.port,
            "backend": args.backend,
            "model": args.model,
            "served_model_name": args.served_model_name,
            "admin_key": args.admin_key,
            "replicas": args.replicas,
            "workers": args.workers,
            "router_policy": args.router_policy,
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "fairness": args.fairness,
        }
    try:
        settings = load_settings(args.config, overrides)
        if args.command == "serve":
            settings.resolved_backends()  # a flag the chosen backend lacks is a config error
    except (OSError, ValueError) as e:
        print(f"kvgate: bad configuration: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from gateway.serve import run

        run(settings)
        return 0
    if args.command == "models":
        return _models(args.json)
    return cli_admin.run(args, settings)


def _models(as_json: bool) -> int:
    from gateway.default_model import list_models

    cli_admin._print(list_models(), as_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
