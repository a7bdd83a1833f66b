"""Issue 45's untrusted stores as `python -m studies.hostile_surfaces` tries them: an
attacker who can write to the KV disk tier's directory or to its Redis database, and a
tenant's requests afterwards.

Before the gateway restarts (its engines' device caches empty, so every prefix is looked
up in the tiers below), the study writes a few prompts' blocks down, then:

4. replaces one prompt's disk blocks by symlinks to /dev/zero and another's by its file
   grown to a sparse 1 GiB: whether each request is answered, finds none of its prompt
   cached, and how much the gateway's peak memory grows (its address space capped at
   2 GiB over its size, so a reader without bound fails rather than take the machine);
5. moves another prompt's records under one prompt's Redis keys, each header's key
   rewritten to match (a swap whoever can write to that database can make; a CRC over
   the payload still checks): whether the answer equals what it was when computed, and
   whether its prompt is counted (and billed) as cached.

An untouched prompt beside each shows the tier serves what it stored.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import httpx
import redis

from studies.hostile_surfaces_setup import (
    DISK,
    SHARED,
    Gateway,
    Outcome,
    cap_address_space,
    peak_rss_mib,
    reset_peak_rss,
)

KEY_PREFIX = b"kvgate:kv:"
KEY_OFFSET = 24  # a record's header: magic (4), version (2), 0 (2), fingerprint (16), key (32)
SPARSE_BYTES = 1 << 30
SENTENCE = "Paged attention stores keys and values in fixed-size blocks. "


def prompt(tag: str) -> str:
    """About ten blocks of the byte-token model's prompt, its own from the first one."""
    return f"{tag}: " + SENTENCE * 3


@dataclass
class Stored:
    """What was written down before the restart: each prompt's disk files and Redis
    keys, and the answers computed from scratch."""

    files: dict[str, list[str]] = field(default_factory=dict)
    keys: dict[str, list[bytes]] = field(default_factory=dict)
    answers: dict[str, str] = field(default_factory=dict)


def ask(gw: Gateway, model: str, tag: str, timeout: float = 120) -> tuple[int, str, int]:
    """A greedy completion of prompt(tag): status, text and cached prompt tokens."""
    body = {"model": model, "prompt": prompt(tag), "max_tokens": 8, "temperature": 0}
    try:
        answer = gw.post("/v1/completions", body, gw.tenant("stores"), timeout=timeout)
    except httpx.HTTPError as e:  # a gateway that died or hangs is the finding
        return 0, type(e).__name__, 0
    if answer.status_code != 200:
        return answer.status_code, "", 0
    data = answer.json()
    details = data["usage"].get("prompt_tokens_details") or {}
    return 200, data["choices"][0]["text"], details.get("cached_tokens") or 0


def _settled(listing, timeout: float = 60) -> set:
    """`listing()` once it stopped growing for a second (the tiers write behind)."""
    deadline, seen, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        now = listing()
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > 1:
            break
        time.sleep(0.1)
    return seen


def write_down(gw: Gateway, store: redis.Redis) -> Stored:
    """Each prompt computed once, and what of it the disk directory and Redis got."""
    stored = Stored()
    disk = gw.workdir / "kv-disk"

    def files() -> frozenset:
        return frozenset(str(p) for p in disk.rglob("*.kvb"))

    def keys() -> frozenset:
        return frozenset(store.scan_iter(match=KEY_PREFIX + b"*"))

    for model, tags, listing, into in [
        (DISK, ("untouched-disk", "zero", "sparse"), files, stored.files),
        (SHARED, ("untouched-shared", "swapped", "donor"), keys, stored.keys),
    ]:
        before = _settled(listing)
        for tag in tags:
            status, stored.answers[tag], _ = ask(gw, model, tag)
            assert status == 200, f"{model} {tag}: {status}"
            now = _settled(listing)
            into[tag] = sorted(now - before)
            before = now
    return stored


def tamper(stored: Stored, store: redis.Redis) -> None:
    """What the attacker does while the gateway is down."""
    for path in stored.files["zero"]:
        os.unlink(path)
        os.symlink("/dev/zero", path)
    for path in stored.files["sparse"]:
        os.truncate(path, SPARSE_BYTES)
    # every key gets a donor's record, whichever of the two prompts has more blocks
    for name, donor in zip(stored.keys["swapped"], itertools.cycle(stored.keys["donor"])):
        record = bytearray(store.get(donor))
        key = bytes.fromhex(name.rsplit(b":", 1)[1].decode()).ljust(32, b"\0")
        record[KEY_OFFSET : KEY_OFFSET + 32] = key
        store.set(name, bytes(record))


def forged_record(gw: Gateway, stored: Stored) -> Outcome:
    """Item 5, after the restart."""
    _, _, control = ask(gw, SHARED, "untouched-shared")
    status, text, cached = ask(gw, SHARED, "swapped")
    row = gw.rows("stores")[-1]
    same = text == stored.answers["swapped"]
    figure = (
        f"{len(stored.keys['swapped'])} records swapped: {status}, answer "
        f"{'as computed' if same else 'changed'}, {cached} tokens cached "
        f"(row: {row['cached_tokens']}); untouched: {control} cached"
    )
    ok = status == 200 and same and cached == row["cached_tokens"] == 0
    return Outcome(5, "Redis records swapped, CRC intact", ok, figure)


def untrusted_files(gw: Gateway, stored: Stored) -> list[Outcome]:
    """Item 4, after the restart: the peak memory each request added, under a cap."""
    _, _, control = ask(gw, DISK, "untouched-disk")  # the engine's own first use, too
    cap_address_space(gw.pid, 2)
    out = []
    # the sparse files first: a reader without bound fails on /dev/zero, and may stay broken
    for tag, name in (("sparse", "sparse 1 GiB files"), ("zero", "symlinks to /dev/zero")):
        rss = reset_peak_rss(gw.pid) if gw.proc.proc.poll() is None else 0
        status, _, cached = ask(gw, DISK, tag)
        alive = gw.proc.proc.poll() is None
        grown = max(peak_rss_mib(gw.pid) - rss, 0) if alive else float("nan")
        figure = (
            f"{len(stored.files[tag])} blocks: {status or 'no answer'}, {cached} cached, "
            f"peak RSS +{grown:.0f} MiB{'' if alive else ', the gateway died'}; "
            f"untouched: {control} cached"
        )
        # a record is a few KiB: tens of MiB is the engine's own noise, a GiB the file
        ok = status == 200 and cached == 0 and alive and grown < 64
        out.append(Outcome(4, f"disk tier: {name}", ok, figure))
    return out
