"""`kvgate worker`: its flags, its configuration, and the process's life.

The engine flags are `kvgate serve`'s (add_engine_args, one definition for both) and
become a BackendSpec through the same code (Settings.resolved_backends); `--options`
adds engine options (a JSON object) that serve takes from a [[backends]] entry. A
worker is one replica of one backend. The KV tiers' secret comes from the config file
or KVGATE_KV_TIER_SECRET (how its supervisor passes it), never from a flag.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import sys
from dataclasses import replace
from typing import Any

from gateway.config_backends import ENGINE_SETTINGS, check_no_kv_tier_secret, with_kv_tier_secret
from gateway.config_load import load_settings
from gateway.worker_pool import READY_LINE

ENGINE_CHOICES = ["auto", "fake", "gpu", "local"]
# The engines' defaults, for --help only (the engines own them; a test holds these to
# backend_local's and backend_gpu's EngineConfig): importing the engines here would
# make every `kvgate` command start slowly.
LOCAL_DEFAULTS = {"n_ctx": 16384, "n_parallel": 4}
GPU_DEFAULTS = {
    "max_num_seqs": 256,
    "gpu_memory_utilization": 0.9,
    "device": "auto",
    "dtype": "auto",
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "kv_offload_gb": 0,
    "kv_disk_gb": 16,
}
LORA_DEFAULTS = {"max_loras": 4, "max_lora_rank": 64}  # both engines' max_loras


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags of `kvgate serve` and `kvgate worker`. Unset ones leave the
    setting to the config file, KVGATE_*, then the engine's default."""
    p.add_argument(
        "--backend",
        choices=ENGINE_CHOICES,
        help="auto (default): gpu with CUDA, else local (llama.cpp), else fake",
    )
    p.add_argument(
        "--model", metavar="PATH", help="GGUF file or HF directory (default: Gemma 3 270M)"
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id clients send (default: the model's)",
    )
    p.add_argument(
        "--fairness",
        choices=["vtc", "fcfs"],
        help="how tenants share a backend: vtc (default, the Virtual Token Counter) or fcfs",
    )
    gpu = p.add_argument_group("gpu backend (kvgate's PyTorch engine)")
    gpu.add_argument(
        "--quantization",
        choices=["fp8", "int8"],
        help="8-bit weights, made at load (default: none)",
    )
    gpu.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        help="fp8 holds twice the blocks (default auto)",
    )
    gpu.add_argument(
        "--max-model-len", type=int, metavar="N", help="tokens per sequence (default: the model's)"
    )
    gpu.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help=f"sequences scheduled together (default {GPU_DEFAULTS['max_num_seqs']})",
    )
    gpu.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="share of the GPU's memory the engine may take, weights and KV cache "
        f"(default {GPU_DEFAULTS['gpu_memory_utilization']})",
    )
    gpu.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        help="where the engine runs; auto: CUDA when torch sees a GPU, else the CPU "
        f"(default {GPU_DEFAULTS['device']})",
    )
    gpu.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="weights and activations; auto: bfloat16 on CUDA, float32 on the CPU "
        f"(default {GPU_DEFAULTS['dtype']})",
    )
    gpu.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="split the model over N devices (GPUs, or processes on the CPU), one process "
        f"each (default {GPU_DEFAULTS['tensor_parallel_size']})",
    )
    gpu.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=None,
        help="a mixture-of-experts model's tensor-parallel ranks each hold a share of the "
        "experts whole instead of a slice of every expert",
    )
    gpu.add_argument(
        "--pipeline-parallel-size",
        type=int,
        metavar="N",
        help="split the model's layers into N stages, each on its own tensor-parallel "
        f"ranks (default {GPU_DEFAULTS['pipeline_parallel_size']})",
    )
    tiers = p.add_argument_group(
        "KV tiers of the gpu backend (blocks the KV cache evicts are kept there and "
        "loaded back on a prefix hit); the local backend takes the disk's two"
    )
    tiers.add_argument(
        "--kv-offload-gb",
        type=float,
        metavar="GB",
        help=f"GiB of host memory for them (default {GPU_DEFAULTS['kv_offload_gb']}: none)",
    )
    tiers.add_argument(
        "--kv-disk-path", metavar="DIR", help="a directory for them that outlives restarts"
    )
    tiers.add_argument(
        "--kv-disk-gb",
        type=float,
        metavar="GB",
        help=f"GiB --kv-disk-path may hold (default {GPU_DEFAULTS['kv_disk_gb']})",
    )
    tiers.add_argument(
        "--kv-shared-url",
        metavar="URL",
        help="a Redis store shared by the engines of one model, e.g. redis://host:6379/0",
    )
    lora = p.add_argument_group(
        "LoRA adapters (vLLM's flags; gpu backend, and --enable-lora and --max-loras for local)"
    )
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters over the model (implied by any adapter given)",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        help=f"adapters resident at once, the rest loaded on demand (default {LORA_DEFAULTS['max_loras']})",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        metavar="N",
        help=f"the largest rank an adapter may have (default {LORA_DEFAULTS['max_lora_rank']})",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        metavar="N",
        help="adapters kept in host memory (default: twice --max-loras)",
    )
    local = p.add_argument_group("local backend (llama.cpp)")
    local.add_argument(
        "--n-parallel",
        type=int,
        metavar="N",
        help=f"sequences decoded together (default {LOCAL_DEFAULTS['n_parallel']})",
    )
    local.add_argument(
        "--n-ctx",
        type=int,
        metavar="N",
        help="KV cells shared by the sequences: each holds n_ctx / n_parallel tokens "
        f"(default {LOCAL_DEFAULTS['n_ctx']})",
    )
    local.add_argument(
        "--n-threads", type=int, metavar="N", help="CPU threads (default: one per core, up to 8)"
    )


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """add_engine_args' values as load_settings overrides (None: not given)."""
    names = ("backend", "model", "served_model_name", "fairness", *ENGINE_SETTINGS)
    return {name: getattr(args, name) for name in names}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run one engine in its own process, served over HTTP")
    p.add_argument("--host", default="127.0.0.1", help="default %(default)s")
    p.add_argument(
        "--port", type=int, default=8001, help="0: any free port (printed); default %(default)s"
    )
    add_engine_args(p)
    p.add_argument(
        "--options", type=_json_object, default={}, help='engine options, e.g. {"n_batch": 256}'
    )
    p.add_argument("--worker-token", help="callers must send it (or KVGATE_WORKER_TOKEN)")
    p.add_argument(
        "--role",
        choices=["prefill", "decode", "both"],
        default="both",
        help="prefill: computes long prompts for decode workers; decode: continues from "
        "their blocks; both (default): serves whole requests (prefill and decode need the "
        "gpu backend, and paired workers one worker token)",
    )
    p.add_argument(
        "--kv-pull-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a decode worker's bound on pulling a prompt's blocks from a prefill worker; "
        "past it the prompt is computed here (default %(default)s)",
    )
    p.add_argument("--cpus", type=_cpu_list, help="run on these CPU cores only, e.g. 0-3 or 0,2")
    p.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    p.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry traces to this OTLP endpoint (or the standard "
        "OTEL_EXPORTER_OTLP_* variables); a gateway's traceparent continues its trace",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="on SIGTERM, how long requests in flight may take to finish before the "
        "streams still open are cut (default 30, or KVGATE_DRAIN_TIMEOUT_S)",
    )


def run(args: argparse.Namespace) -> int:
    token = args.worker_token or os.environ.get("KVGATE_WORKER_TOKEN") or None
    if token is None and not is_loopback(args.host):
        print(
            f"kvgate worker: refusing to listen on {args.host} without a worker token: anyone "
            "who reaches it could use the engine. Set --worker-token or KVGATE_WORKER_TOKEN.",
            file=sys.stderr,
        )
        return 2
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # before the engine sizes its thread pools
    from gateway.backends import build_backends

    overrides = {"host": args.host, "port": args.port, "replicas": 1} | engine_overrides(args)
    overrides["otlp_traces_endpoint"] = args.otlp_traces_endpoint
    overrides["drain_timeout_s"] = args.drain_timeout
    try:
        settings = load_settings(args.config, overrides)
        specs = settings.resolved_backends()
        if len(specs) != 1:
            raise ValueError(f"a worker runs one backend; the configuration has {len(specs)}")
        check_no_kv_tier_secret(args.options, "--options")
        spec = replace(specs[0], options=specs[0].options | args.options)
        if args.role != "both":  # the engine keeps host rows to send or take blocks
            if spec.type != "gpu":
                raise ValueError(f"--role {args.role} needs the gpu backend, not {spec.type!r}")
            if not settings.kv_tier_secret:
                raise ValueError(
                    f"--role {args.role} needs kv_tier_secret (KVGATE_KV_TIER_SECRET), the "
                    "same on paired workers: each checks the other's KV blocks with it"
                )
            spec = replace(spec, options=spec.options | {"kv_transfer": True})
        spec = with_kv_tier_secret(spec, settings.kv_tier_secret)
        backends = build_backends(spec)
        if len(backends) != 1:
            raise ValueError("a worker is one replica: run one worker per replica")
    except (OSError, ValueError) as e:
        print(f"kvgate worker: bad configuration: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from gateway.observe.tracing import Tracing, trace_export
    from gateway.worker.kv_pull import KVPuller
    from gateway.worker.state import WorkerState

    puller = KVPuller(token, args.kv_pull_timeout)
    state = WorkerState(settings, backends[0], spec.type, token, args.role, puller)
    if export := trace_export(settings.otlp_traces_endpoint, "kvgate-worker"):
        state.tracing = Tracing(export)
    try:
        died = _run_loop(_serve(state, args.parent_pid))
    except Exception as e:  # the engine did not start: say why in one line, then exit
        logging.getLogger("kvgate.worker").debug("start-up failed", exc_info=True)
        print(f"kvgate worker: cannot start: {e}", file=sys.stderr)
        return 1
    if died:
        print(f"kvgate worker: the engine died ({died}); exiting", file=sys.stderr)
        return 1
    return 0


async def _serve(state, parent_pid: int | None) -> str:
    """Serve until told to stop (""), or until a gpu engine dies (why it died): a dead
    engine (a failed step, a lost tensor-parallel rank) would answer only 503s, so the
    worker exits and its supervisor starts a fresh one."""
    from aiohttp import web

    from gateway.http.drain import CUT_GRACE_S, until_signalled
    from gateway.http.server import GatewayRunner
    from gateway.worker.app import create_worker_app

    settings = state.settings
    runner = GatewayRunner(
        create_worker_app(state), settings, access_log=None, shutdown_timeout=CUT_GRACE_S
    )
    await runner.setup()  # starts the engine
    stop = asyncio.Event()
    watcher = None if parent_pid is None else asyncio.create_task(_watch_parent(parent_pid, stop))
    died: list[str] = []
    engine_watch = asyncio.create_task(_watch_engine(state, stop, died))
    try:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        print(f"{READY_LINE}http://{host}:{port}", flush=True)
        await until_signalled(
            state.drain, lambda: settings.drain_timeout_s, "kvgate worker", None, stop
        )
    finally:
        if watcher is not None:
            watcher.cancel()
        engine_watch.cancel()
        await runner.cleanup()
    return died[0] if died else ""


async def _watch_engine(state, stop: asyncio.Event, died: list[str]) -> None:
    """Set `stop` (and say why in `died`) once the gpu engine has failed for good."""
    if state.kind != "gpu":
        return
    while not stop.is_set():
        await asyncio.sleep(1)
        if state.backend.failure is not None:
            died.append(repr(state.backend.failure))
            stop.set()


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    """A supervised worker must not outlive its supervisor (it would hold the engine's
    memory and its port): when the parent is gone the process is re-parented."""
    while os.getppid() == pid:
        await asyncio.sleep(1)
    stop.set()


def _run_loop(coro):
    try:
        import uvloop  # the event loop is most of the per-request cost, as in serve
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _cpu_list(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6] (the shape of taskset's and cgroups' lists)."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r}") from None
    if not cpus:
        raise argparse.ArgumentTypeError("no CPUs given")
    return cpus
