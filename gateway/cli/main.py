"""The `kvgate` command."""

from __future__ import annotations

import argparse
import os
import sys

from gateway.cli import adapters as cli_adapters
from gateway.cli import admin_args
from gateway.cli import plan as cli_plan
from gateway.cli.output import print_rows
from gateway.cli.parsing import Parser
from gateway.config import Settings
from gateway.config_load import ConfigSource, load_settings
from gateway.worker import cli as worker_cli

_DELEGATED = {
    "top": "tui.cli",
    "bench": "bench.cli",
    "chat": "gateway.cli.chat",
    "tune": "bench.tune",
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvgate", description=__doc__)
    _add_global_args(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    # no argparse defaults: an unset flag leaves the setting to the config file and KVGATE_*
    serve.add_argument(
        "--host",
        metavar="ADDR",
        help=f"address to listen on; 0.0.0.0: all (default {Settings.host}, or KVGATE_HOST)",
    )
    serve.add_argument(
        "--port",
        type=int,
        metavar="N",
        help=f"port to listen on (default {Settings.port}, or KVGATE_PORT)",
    )
    serve.add_argument(
        "--admin-key", metavar="KEY", help="bootstrap admin key (or KVGATE_ADMIN_KEY)"
    )
    serve.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help=f"engine replicas of --backend (default {Settings.replicas})",
    )
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="run each engine as N `kvgate worker` processes (one per GPU, or the cores "
        "split); default: in this process",
    )
    serve.add_argument(
        "--prefill-workers",
        type=int,
        metavar="M",
        help="of the --workers, M prefill long prompts and the rest decode (default 0: "
        "every worker does both)",
    )
    serve.add_argument(
        "--prefill-threshold",
        type=int,
        metavar="TOKENS",
        help=f"with prefill workers: prompts this long or longer are prefilled on one "
        f"(default {Settings.prefill_threshold})",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="on SIGTERM, how long requests in flight may take to finish before the "
        f"streams still open are cut (default {Settings.drain_timeout_s:g}, or "
        "KVGATE_DRAIN_TIMEOUT_S)",
    )
    serve.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry traces to this OTLP endpoint (vLLM's flag; or "
        "KVGATE_OTLP_TRACES_ENDPOINT, or the standard OTEL_EXPORTER_OTLP_* variables)",
    )
    serve.add_argument(
        "--router-policy",
        metavar="POLICY",
        help="prefix (default: where the prompt's prefix is cached), round_robin, least_loaded",
    )
    serve.add_argument(
        "--models-dir",
        metavar="DIR",
        help="serve every .gguf file in DIR, named by its file's stem: listed at once, "
        "loaded on first use, unloaded when unused for --keep-alive (files added or removed "
        "appear or go within seconds, or on POST /admin/reload)",
    )
    serve.add_argument(
        "--models-max",
        type=int,
        metavar="N",
        help="with --models-dir: models resident at once; loading one more unloads the "
        f"least recently used idle one (default {Settings.models_max})",
    )
    serve.add_argument(
        "--models-memory-gb",
        type=float,
        metavar="GB",
        help="with --models-dir: the resident models' files may add up to this much; a "
        "load that would not fit is a 503 (default: 0.8 of the machine's memory)",
    )
    serve.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help="with --models-dir: a model unused this long is unloaded (Ollama's: 5m, 1h, "
        f"seconds; negative: never; default {Settings.keep_alive}); a request's keep_alive "
        "overrides it",
    )
    serve.add_argument(
        "--verbose",
        action="store_true",
        help="also show other libraries' logs (database migrations, llama.cpp's load "
        "messages, the workers' output) and the traceback of a backend that fails to start",
    )
    worker_cli.add_engine_args(serve)
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="public LoRA adapters over the model (vLLM's flag): NAME=PATH, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    serve.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="how replies' reasoning is read (vLLM's names: deepseek_r1, qwen3, openai); "
        "default: detected from each model's chat template and config",
    )
    serve.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="how replies' tool calls are read (vLLM's names: hermes, llama3_json, mistral, "
        "qwen3_coder, pythonic, deepseek_v3, openai); default: detected, else hermes",
    )

    worker_cli.add_parser(sub)
    sub.add_parser("models", help="list the models kvgate can serve and where they live")
    cli_plan.add_parser(sub)
    sub.add_parser("top", help="live dashboard of a running gateway", add_help=False)
    sub.add_parser("bench", help="benchmarks against any OpenAI-compatible server", add_help=False)
    sub.add_parser(
        "tune", help="the engine settings that serve a workload best within goals", add_help=False
    )
    sub.add_parser("chat", help="chat with a model in the terminal", add_help=False)
    admin_args.add_commands(sub)
    cli_adapters.add_commands(sub)
    _accept_global_args_anywhere(parser)
    return parser


def _add_global_args(parser: argparse.ArgumentParser, top_level: bool) -> None:
    default = None if top_level else argparse.SUPPRESS  # see _accept_global_args_anywhere
    parser.add_argument(
        "--config", default=default, metavar="FILE", help="TOML config file (or KVGATE_CONFIG)"
    )
    parser.add_argument(
        "--database-url",
        default=default,
        metavar="URL",
        help=f"or KVGATE_DATABASE_URL (default {Settings.database_url})",
    )
    parser.add_argument(
        "--database-schema", default=default, metavar="NAME", help="PostgreSQL schema (search_path)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if top_level else argparse.SUPPRESS,
        help="print JSON, for scripts (default: tables)",
    )


def _accept_global_args_anywhere(parser: argparse.ArgumentParser) -> None:
    """`kvgate serve --config f.toml` as well as `kvgate --config f.toml serve`: users
    type both. A subcommand's copy of a global flag defaults to SUPPRESS, so when it is
    not given the value from before the subcommand stands."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, child in action.choices.items():
            if name in _DELEGATED or "--config" in child._option_string_actions:
                continue  # a delegated command owns its flags; an alias is done already
            _add_global_args(child, top_level=False)
            _accept_global_args_anywhere(child)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # `top`, `bench`, `chat` and `tune` own their flags: hand them everything after it.
    for i, arg in enumerate(argv):
        if arg in _DELEGATED:
            import importlib

            return importlib.import_module(_DELEGATED[arg]).main(argv[i + 1 :])
        if not arg.startswith("-"):
            break
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        return worker_cli.run(args)
    if args.command == "adapters":
        return cli_adapters.run(args)
    if args.command == "plan":
        return cli_plan.run(args)
    overrides = {
        "database_url": args.database_url,
        "database_schema": args.database_schema,
    }
    if args.command == "serve":
        overrides |= {
            "host": args.host,
            "port": args.port,
            "admin_key": args.admin_key,
            "replicas": args.replicas,
            "workers": args.workers,
            "prefill_workers": args.prefill_workers,
            "prefill_threshold": args.prefill_threshold,
            "router_policy": args.router_policy,
            "otlp_traces_endpoint": args.otlp_traces_endpoint,
            "drain_timeout_s": args.drain_timeout,
            "lora_modules": args.lora_modules,
            "reasoning_parser": args.reasoning_parser,
            "tool_call_parser": args.tool_call_parser,
            "models_dir": args.models_dir,
            "models_max": args.models_max,
            "models_memory_gb": args.models_memory_gb,
            "keep_alive": args.keep_alive,
        } | worker_cli.engine_overrides(args)
    # a reload reads the same file again, under the same variables and flags
    source = ConfigSource(args.config or os.environ.get("KVGATE_CONFIG"), overrides)
    try:
        settings = (
            source.load() if args.command == "serve" else load_settings(args.config, overrides)
        )
    except (OSError, ValueError) as e:
        print(f"kvgate: bad configuration: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from gateway.cli.serve import run

        return run(settings, verbose=args.verbose, source=source)
    if args.command == "models":
        return _models(args.json)
    from gateway.cli import admin  # the database layer: for these commands alone

    return admin.run(args, settings)


def _models(as_json: bool) -> int:
    from gateway.backends.default_model import list_models

    print_rows(list_models(), as_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
