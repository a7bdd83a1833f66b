"""Command-line options shared by `bench serve` and `bench sweep`, and what they build."""

from __future__ import annotations

import argparse
import copy
import math
import os

from bench.datasets import (
    DEFAULT_SHAREGPT,
    SampleRequest,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from bench.metrics import METRIC_NAMES
from bench.serve import ServeConfig


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` shows each option's default, except None and a switch's False (nothing
    to show), and where the help already says it; descriptions keep their line breaks."""

    def _format_action(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and "(default" not in text and _shown(action.default):
            # argparse prints no help line for an option without help: give it one
            action = copy.copy(action)
            action.help = f"{text} (default: %(default)s)".lstrip()
        return super()._format_action(action)


def _shown(default: object) -> bool:
    return not any(default is v for v in (None, False, argparse.SUPPRESS))


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(
                f"--goodput takes NAME:MS pairs with NAME in ttft|tpot|e2el, got {pair!r}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of ms") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be >= 0 ms")
    return slos


def parse_metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown:
        raise ValueError(
            f"--percentile-metrics: unknown {unknown}; choose from {list(METRIC_NAMES)}"
        )
    return names


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must lie in [0, 100], got {text!r}")
    return values


def read_api_keys(api_key: str | None, api_key_file: str | None) -> list[str]:
    """Keys from a comma-separated list, a file (one per line), or, as `kvgate chat`
    reads its key, $KVGATE_API_KEY, else $OPENAI_API_KEY."""
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip() and not line.startswith("#")]
    if api_key is None:
        api_key = os.environ.get("KVGATE_API_KEY") or os.environ.get("OPENAI_API_KEY", "")
    return [k.strip() for k in api_key.split(",") if k.strip()]


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", help="model id (default: the server's first model)")
    p.add_argument(
        "--api-key",
        help="API key, or comma-separated keys, one per tenant (default: $KVGATE_API_KEY, "
        "else $OPENAI_API_KEY); no run record keeps it",
    )
    p.add_argument(
        "--api-key-file", help="file with one API key per line, one per tenant (# comments)"
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=["random", "shared-prefix", "sharegpt"], default="random")
    p.add_argument("--dataset-path", help="ShareGPT-format JSON (default: the bundled one)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt (suffix) words")
    p.add_argument("--output-len", type=int, help="max_tokens (default 64; sharegpt: the reply)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths in [L(1-r), L(1+r)]")
    p.add_argument("--shared-prefix-len", type=int, default=512)
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument(
        "--prefix-order",
        choices=["cycle", "random"],
        default="cycle",
        help="shared-prefix: prefixes take turns, or each request draws one at random and "
        "is sent by the tenant of that index (a system prompt per tenant)",
    )
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s, Poisson; inf: all at once"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    p.add_argument("--num-tenants", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="fixed output lengths (vLLM, kvgate)")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def build_requests(args: argparse.Namespace) -> list[SampleRequest]:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "sharegpt":
        return sharegpt_requests(
            args.num_prompts, args.dataset_path or DEFAULT_SHAREGPT, args.output_len, args.seed
        )
    output_len = args.output_len or 64
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(
            args.num_prompts,
            args.shared_prefix_len,
            args.input_len,
            output_len,
            args.range_ratio,
            args.num_prefixes,
            args.seed,
            args.prefix_order == "random",
        )
    return random_requests(
        args.num_prompts, args.input_len, output_len, args.range_ratio, args.seed
    )


def workload_info(args: argparse.Namespace) -> dict:
    info = {"dataset": args.dataset, "input_len": args.input_len, "output_len": args.output_len}
    if args.dataset == "shared-prefix":
        info |= {k: getattr(args, k) for k in ("shared_prefix_len", "num_prefixes", "prefix_order")}
    if args.dataset == "sharegpt":
        info["dataset_path"] = args.dataset_path or "bundled"
    info["range_ratio"] = args.range_ratio
    return info


def request_shape(args: argparse.Namespace) -> dict:
    """How the requests are sent, beside what they hold (workload_info): a run's record
    keeps both, as what makes two runs the same workload (`bench compare`)."""
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    shape = {"endpoint": args.endpoint, "request_rate": rate, "burstiness": args.burstiness}
    shape |= {"num_tenants": args.num_tenants, "seed": args.seed}
    return shape | {"temperature": args.temperature, "ignore_eos": args.ignore_eos}


def serve_config(args: argparse.Namespace, max_concurrency: int | None = None) -> ServeConfig:
    return ServeConfig(
        url=args.url,
        model=args.model,
        api_keys=read_api_keys(args.api_key, args.api_key_file),
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=max_concurrency,
        num_tenants=args.num_tenants,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        percentile_metrics=parse_metric_names(args.percentile_metrics),
        metric_percentiles=parse_percentiles(args.metric_percentiles),
        goodput=parse_goodput(args.goodput),
        show_progress=not args.no_progress,
    )
