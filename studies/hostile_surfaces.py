"""What an attacker with a tenant key and an admin in a hurry found in issue 45, tried
against one commit's gateway and another's in one run:

    python -m studies.hostile_surfaces --before e74401a [--after HEAD] [--items 1,4,5]

Each side runs from a checkout of its commit (`git worktree`, on this tree's virtual
environment; without --after, this working tree), as real `kvgate serve` processes: one
on fake backends (a paced generator, an embedder) and one on gpu engines on the CPU
(tiny random models: a 51.7M Llama that prefills in chunks of 8 and takes LoRA adapters,
a Qwen3 embedder, two with a KV disk tier and a Redis tier, one that stops at once).
Every case sends what a tenant or an admin can send and reads what they can read (the
answer, the usage rows, GET /admin/...), plus the server's peak memory:

  1 hang-ups during prefill (chat, Messages, Responses) and embedding: rows billed
  2 an adapter deleted mid-stream: the spend     3 adapter files cut after registration
  4 disk-tier files made symlinks to /dev/zero and sparse 1 GiB files
  5 Redis records swapped under other keys       6 reloads of bad configs
  7 corrupt and huge adapter files registered    8 token-id inputs of the wrong type
  9 /tokenize and count_tokens after a 429       10 bench history and the API key
  11 bench on a model that stops at once         12 bench compare of other prompts

A case records whether the side did what the issue asks, and the figure it saw; one
whose code lacks what it needs fails with the error it met. It prints the table side by
side and writes it to --out (JSON) and --markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import redis

from bench.options import DefaultsHelpFormatter
from studies import hostile_surfaces_admin as admin
from studies import hostile_surfaces_bench as benchmark
from studies import hostile_surfaces_billing as billing
from studies import hostile_surfaces_stores as stores
from studies.hostile_surfaces_report import markdown, print_table
from studies.hostile_surfaces_setup import (
    ROOT,
    Gateway,
    Models,
    Outcome,
    engine_config,
    fake_config,
    git,
    worktree,
)

ENGINE_ITEMS = {1, 3, 4, 5, 7, 11}
Step = tuple[int, str, Callable[[Gateway], Outcome | list[Outcome]]]


# the cases on the fake gateway, the reloads last (they change its config)
FAKE_STEPS: list[Step] = [
    (8, "embedding token-id errors", admin.token_id_errors),
    (9, "/tokenize and count_tokens after a 429", admin.counted_after_429),
    (2, "adapter deleted mid-stream", billing.adapter_deleted_midway),
    (10, "bench history and the API key", benchmark.no_key_kept),
    (12, "bench compare of other prompts", benchmark.compare_workloads),
    (6, "reloads", admin.reloads),
]


def engine_steps(args: argparse.Namespace, models: Models) -> list[Step]:
    """The cases on the gpu gateway before its tiers are tampered with."""
    broken_later = partial(billing.adapter_broken_later, adapter=models.adapter)
    corrupt = partial(admin.corrupt_adapters, good=models.adapter, huge_mib=args.huge_config_mib)
    return [
        (1, "hang-ups in prefill", billing.prefill_hangups),
        (1, "hang-up while embedding", billing.embedding_hangup),
        (3, "adapter files cut after registration", broken_later),
        (7, "corrupt adapters", corrupt),
        (11, "bench on a model that stops at once", benchmark.silent_model),
    ]


def run_steps(gw: Gateway, steps: list[Step], items: set[int]) -> list[Outcome]:
    """Each chosen step; one that raises is a failure of its case, with the error."""
    out: list[Outcome] = []
    for item, title, step in steps:
        if item not in items:
            continue
        print(f"  item {item}: {title}", file=sys.stderr, flush=True)
        try:
            got = step(gw)
        except Exception as e:  # the side's code met something it lacks
            traceback.print_exc()
            got = Outcome(item, title, False, f"error: {type(e).__name__}: {str(e)[:120]}")
        out += got if isinstance(got, list) else [got]
    return out


def run_side(
    tree: Path, workdir: Path, models: Models | None, args: argparse.Namespace
) -> list[Outcome]:
    """One side's chosen cases, its gateways started from `tree`."""
    shutil.rmtree(workdir, ignore_errors=True)  # a --workdir kept from an earlier run
    workdir.mkdir(parents=True)
    out: list[Outcome] = []
    if args.items - ENGINE_ITEMS:
        fake = Gateway(tree, workdir, "fake", fake_config()).start()
        try:
            out += run_steps(fake, FAKE_STEPS, args.items)
        finally:
            fake.stop()
    if args.items & ENGINE_ITEMS:
        out += run_engines(tree, workdir, models, args)
    return out


def run_engines(
    tree: Path, workdir: Path, models: Models, args: argparse.Namespace
) -> list[Outcome]:
    """The gpu gateway's cases; for 4 and 5, its tiers written, tampered with while it
    is down, and read again by a fresh process."""
    store = redis.Redis.from_url(args.redis_url)
    _clear(store)
    engines = Gateway(tree, workdir, "engines", engine_config(models, workdir, args.redis_url))
    engines.start()
    tiers = {4, 5} & args.items
    try:
        out = run_steps(engines, engine_steps(args, models), args.items)
        stored = stores.write_down(engines, store) if tiers else None
    finally:
        engines.stop()
    if not tiers:
        return out
    try:
        stores.tamper(stored, store)
        engines.start("engines-restarted")
        try:
            steps = [
                (5, "Redis records swapped", partial(stores.forged_record, stored=stored)),
                (4, "disk tier files", partial(stores.untrusted_files, stored=stored)),
            ]
            out += run_steps(engines, steps, args.items)
        finally:
            engines.stop()
    finally:
        _clear(store)
    return out


def _clear(store: redis.Redis) -> None:
    """The KV tier's keys in the study's Redis database: each side starts with none."""
    for name in store.scan_iter(match=stores.KEY_PREFIX + b"*"):
        store.delete(name)


def run(args: argparse.Namespace, tmp: Path) -> dict:
    models = Models.build(args.models or tmp / "models") if args.items & ENGINE_ITEMS else None
    sides = {} if args.before is None else {"before": args.before}
    sides["after"] = args.after
    result: dict = {"sides": list(sides), "commits": {}, "outcomes": {}}
    result["loadavg_start"] = Path("/proc/loadavg").read_text().split()[:3]
    for side, rev in sides.items():
        print(f"side {side}: {rev or 'this working tree'}", file=sys.stderr, flush=True)
        if rev is None:
            result["commits"][side] = "working tree at " + git("describe", "--always", "--dirty")
            outcomes = run_side(ROOT, tmp / side, models, args)
        else:
            result["commits"][side] = git("rev-parse", "--short", rev)
            with worktree(rev, tmp / f"tree-{side}") as tree:
                outcomes = run_side(tree, tmp / side, models, args)
        result["outcomes"][side] = [vars(o) for o in outcomes]
    result["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--before", help="the commit before the fixes (none: only one side)")
    p.add_argument("--after", help="the commit after them (default: this working tree)")
    p.add_argument("--items", default="1,2,3,4,5,6,7,8,9,10,11,12", help="issue 45's items")
    p.add_argument("--huge-config-mib", type=int, default=256, help="item 7's adapter_config.json")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/9", help="items 4-5's store")
    p.add_argument("--models", type=Path, help="keep the built models here")
    p.add_argument("--workdir", type=Path, help="keep databases, logs and files here")
    p.add_argument("--out", type=Path, default=Path("docs/perf/hostile_surfaces.json"))
    p.add_argument("--markdown", type=Path, help="the table as Markdown, to this file")
    args = p.parse_args(argv)
    args.items = {int(i) for i in args.items.split(",")}
    if not args.items <= set(range(1, 13)):
        p.error(f"--items: issue 45's items are 1 to 12; got {sorted(args.items)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        tmp = args.workdir or Path(d)
        result = run(args, tmp.resolve())
    result |= {"cpus": os.cpu_count(), "wall_s": round(time.monotonic() - started)}
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
