"""KV blocks from the device to host memory and back through the host tier's own
copies (backend_gpu/kv_tiers/host.py's HostRows: `copy_down` and `copy_up`, one block
at a time, as the tier stack calls them), against one plain torch copy of the same
bytes (pinned host memory, non_blocking): blocks per second and GB/s each way.

    python -m studies.kv_tiers_copy --out OUTDIR [--shape llama3-8b] [--blocks 512]

studies/gpu_check.sh runs it on the GPU (issue 33's goal: HostRows at least 70% of the
plain copy's GB/s). The KV cache is Llama 3 8B's (32 layers, 8 KV heads of 128, bfloat16,
blocks of 16 tokens: 2 MiB a block, spread over 64 per-layer K and V tensors as the
engine holds it). Before the timing, one round trip (down, caches zeroed, up) must give
the caches back bit for bit. Each figure is the median of --repeats runs.

With --stores it measures the tiers under the rows instead, on the CPU: --store-blocks
records of the shape's block size written (`put`, as the tier stack's writer does) and
read back and checked (`get`; `get_many` in one call, as a lookup asks Redis) through
engine_api.kv_disk's DiskStore in a fresh directory (the page cache, not the disk, is
what they reach) and, with --shared-url, backend_gpu's SharedStore. What it costs is
the records' framing and check (an HMAC-SHA256 since issue 45, a CRC-32 before).

    python -m studies.kv_tiers_copy --out OUTDIR --stores [--shared-url redis://...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from backend_gpu.kv_tiers.host import HostRows
from backend_gpu.kv_tiers.shared import SharedStore
from bench.options import DefaultsHelpFormatter
from engine_api.kv_disk import DiskStore
from engine_api.kv_records import HEADER_SIZE, RecordCodec
from studies.harness import device_environment

# (layers, KV heads, head dim, dtype); "tiny" runs on a CPU in a second (a smoke test)
SHAPES = {
    "llama3-8b": (32, 8, 128, torch.bfloat16),
    "tiny": (2, 2, 16, torch.float32),
}
GOAL = 0.7


def kv_layers(shape: str, num_blocks: int, block_size: int, device: str) -> list:
    """Per layer, a K and a V cache as the engine's attention layers hold them:
    [blocks * block_size, heads, head_dim], random contents."""
    layers, heads, dim, dtype = SHAPES[shape]
    size = (num_blocks * block_size, heads, dim)

    def cache() -> torch.Tensor:
        return torch.randn(size, device=device).to(dtype)

    return [SimpleNamespace(k_cache=cache(), v_cache=cache()) for _ in range(layers)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], None], device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def round_trip_exact(rows: HostRows, layers: list, device: str) -> bool:
    """Every block down, the caches zeroed, every block up: the same bits?"""
    before = [c.clone() for layer in layers for c in (layer.k_cache, layer.v_cache)]
    for b in range(rows.num_rows):
        rows.copy_down(b, b)
    for layer in layers:
        layer.k_cache.zero_()
        layer.v_cache.zero_()
    for b in range(rows.num_rows):
        rows.copy_up(b, b)
    sync(device)
    after = [c for layer in layers for c in (layer.k_cache, layer.v_cache)]
    return all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def rates(seconds: float, num_blocks: int, nbytes: int) -> dict:
    return {
        "seconds": seconds,
        "blocks_per_s": num_blocks / seconds,
        "gb_per_s": nbytes / seconds / 1e9,
    }


def measure(shape: str, num_blocks: int, block_size: int, device: str, repeats: int) -> dict:
    layers = kv_layers(shape, num_blocks, block_size, device)
    rows = HostRows(layers, block_size, num_blocks)
    nbytes = rows.bytes_per_block * num_blocks
    exact = round_trip_exact(rows, layers, device)
    pin = device.startswith("cuda")
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def down() -> None:
        for b in range(num_blocks):
            rows.copy_down(b, b)

    def up() -> None:
        for b in range(num_blocks):
            rows.copy_up(b, b)

    runs = {
        "host_rows_down": down,
        "host_rows_up": up,
        "plain_down": lambda: on_host.copy_(on_device, non_blocking=pin),
        "plain_up": lambda: on_device.copy_(on_host, non_blocking=pin),
    }
    for fn in runs.values():  # once untimed: first-call costs out of the figures
        fn()
    result = {
        name: rates(median_seconds(fn, device, repeats), num_blocks, nbytes)
        for name, fn in runs.items()
    }
    for way in ("down", "up"):
        share = result[f"host_rows_{way}"]["gb_per_s"] / result[f"plain_{way}"]["gb_per_s"]
        result[f"share_{way}"] = share
    result |= {"bytes_per_block": rows.bytes_per_block, "bytes": nbytes, "round_trip_exact": exact}
    result["goal_met"] = exact and min(result["share_down"], result["share_up"]) >= GOAL
    return result


def shape_block_bytes(shape: str, block_size: int) -> int:
    """Bytes of one block of every layer's K and V in `shape`."""
    layers, heads, dim, dtype = SHAPES[shape]
    return 2 * layers * block_size * heads * dim * dtype.itemsize


def put_and_get(
    store: DiskStore | SharedStore, keys: list[bytes], payloads: list[bytes]
) -> tuple[float, float]:
    """Seconds to put every block into `store`, then to read them all back (one
    `get_many` where the store has it, as a lookup asks Redis); checked, untimed."""
    start = time.perf_counter()
    for key, payload in zip(keys, payloads, strict=True):
        store.put(key, payload)
    mid = time.perf_counter()
    if isinstance(store, SharedStore):
        got = store.get_many(keys)
    else:
        got = [store.get(key) for key in keys]
    end = time.perf_counter()
    assert [bytes(g) for g in got] == payloads, "a store gave back other bytes"
    return mid - start, end - mid


def measure_stores(block_bytes: int, num_blocks: int, repeats: int, shared_url: str | None) -> dict:
    """Each store's `put` and `get` of `num_blocks` random blocks: blocks/s and GB/s.
    Every repeat writes new keys (a store writes a key it holds only once) into a new
    directory; the first repeat is not counted (first-call costs)."""
    fp = hashlib.sha256(b"studies.kv_tiers_copy").digest()[:16]
    codec = RecordCodec(fp, secret="studies.kv_tiers_copy")
    record_bytes = HEADER_SIZE + block_bytes
    payloads = [os.urandom(block_bytes) for _ in range(num_blocks)]
    nbytes = block_bytes * num_blocks
    times: dict[str, list[float]] = {}
    for repeat in range(repeats + 1):
        keys = [hashlib.sha256(b"%d %d" % (repeat, i)).digest() for i in range(num_blocks)]
        runs = {}
        with tempfile.TemporaryDirectory(prefix="kv-tiers-copy-") as root:
            disk = DiskStore(root, 2 * nbytes, codec, record_bytes)
            runs["disk"] = put_and_get(disk, keys, payloads)
        if shared_url is not None:
            shared = SharedStore(shared_url, codec, record_bytes)
            runs["shared"] = put_and_get(shared, keys, payloads)
            shared.client.delete(*(shared.prefix + k.hex().encode() for k in keys))
        for store, (put, get) in runs.items():
            if repeat:
                times.setdefault(f"{store}_put", []).append(put)
                times.setdefault(f"{store}_get", []).append(get)
    result = {
        name: rates(statistics.median(runs), num_blocks, nbytes) for name, runs in times.items()
    }
    return result | {"bytes_per_block": block_bytes, "bytes": nbytes}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for kv_tiers_copy.json")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--blocks", type=int, default=512, help="blocks copied each way")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--stores", action="store_true", help="the disk and shared stores, not the host rows"
    )
    p.add_argument("--store-blocks", type=int, default=64, help="blocks each store writes")
    p.add_argument("--shared-url", help="a redis:// URL: measure the shared store there too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.stores:
        return main_stores(args)
    result = {"env": device_environment(args.device), "config": vars(args)}
    result |= measure(args.shape, args.blocks, args.block_size, args.device, args.repeats)
    write(args.out, "kv_tiers_copy.json", result)
    print(f"{args.blocks} blocks of {result['bytes_per_block']:,} bytes, {args.device}")
    print("| copy | way | blocks/s | GB/s |\n|---|---|---:|---:|")
    for name in ("host_rows_down", "plain_down", "host_rows_up", "plain_up"):
        copy, way = name.rsplit("_", 1)
        r = result[name]
        print(f"| {copy} | {way} | {r['blocks_per_s']:,.0f} | {r['gb_per_s']:.2f} |")
    print(
        f"HostRows against the plain copy: down {result['share_down']:.0%}, up "
        f"{result['share_up']:.0%} (goal >= {GOAL:.0%}); round trip exact: "
        f"{result['round_trip_exact']}"
    )
    return result


def main_stores(args: argparse.Namespace) -> dict:
    result = {"env": device_environment("cpu"), "config": vars(args)}
    block_bytes = shape_block_bytes(args.shape, args.block_size)
    result |= measure_stores(block_bytes, args.store_blocks, args.repeats, args.shared_url)
    write(args.out, "kv_tiers_stores.json", result)
    print(f"{args.store_blocks} records of {block_bytes:,} bytes' blocks")
    print("| store | call | blocks/s | GB/s |\n|---|---|---:|---:|")
    for name in ("disk_put", "disk_get", "shared_put", "shared_get"):
        if name in result:
            r = result[name]
            store, call = name.split("_")
            print(f"| {store} | {call} | {r['blocks_per_s']:,.0f} | {r['gb_per_s']:.2f} |")
    return result


def write(out_dir: str, name: str, result: dict) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
