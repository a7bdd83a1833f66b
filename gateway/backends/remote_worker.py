"""The kvgate-worker side of the remote adapter: what a worker says about itself, its
native generate stream, its LoRA adapter calls, its stats, and its KV events turned into
the catalog's.

A worker speaks engine_api's records (GenRequest out, GenChunk lines back), so nothing
is translated but errors; its KV events carry its own replica name and arrive through
a numbered log that may tell the reader to resync (docs: the worker HTTP contract).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import typing
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from engine_api.block_hash import adapter_root, hash_blocks, image_key_spans
from engine_api.errors import BackendError, BadRequestError
from engine_api.images import ImageInput
from engine_api.records import (
    KV_MEDIA,
    AdapterRef,
    BackendStats,
    GenChunk,
    GenRequest,
    KVEvent,
    Progress,
)
from gateway.backends.kv_transfer import BOTH, ROLES
from gateway.backends.remote_abort import opened, stop_and_count
from gateway.backends.remote_http import (
    UpstreamClient,
    parse_json_line,
    relayed_adapter_error,
    stream_error,
)
from gateway.backends.remote_images import request_body

log = logging.getLogger("kvgate.remote")


@dataclass(frozen=True)
class WorkerInfo:
    """The `kvgate` object of a worker's /v1/models entry."""

    backend: str
    block_size: int | None
    prefix_events: bool
    epoch: str
    role: str = BOTH  # prefill | decode | both; a worker from before roles says none
    # a vision model's image placeholder token: the gateway keys an image's blocks by its
    # digest as the worker's engine does (None: the model takes no images)
    image_token_id: int | None = None

    @classmethod
    def parse(cls, data: Any, label: str) -> WorkerInfo:
        d = data if isinstance(data, dict) else {}
        block_size = d.get("block_size")
        image_token_id = d.get("image_token_id")
        ok = (
            isinstance(d.get("backend"), str)
            and (block_size is None or _is_int(block_size) and block_size > 0)
            and isinstance(d.get("prefix_events"), bool)
            and isinstance(d.get("epoch"), str)
            and d.get("role", BOTH) in ROLES
            and (image_token_id is None or _is_int(image_token_id) and image_token_id >= 0)
        )
        if not ok:
            raise BackendError(f"{label} sent an invalid kvgate model entry")
        role = d.get("role", BOTH)
        return cls(d["backend"], block_size, d["prefix_events"], d["epoch"], role, image_token_id)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


async def worker_stream(
    client: UpstreamClient, req: GenRequest, progress: Progress | None = None
) -> AsyncIterator[GenChunk]:
    """The worker's chunks for `req` (already carrying the upstream's model id). Closing
    this iterator closes the connection, which aborts the request in the worker; with
    `progress`, the worker first stops it and says how much of its prompt the engine
    computed (remote_abort.py)."""
    url = client.endpoint.root + "/kvgate/v1/generate"
    body = await request_body(req)  # its images' pixels: encoded off the loop
    resp = await opened(client, url, body, req.request_id, progress)
    finished = False
    try:
        if resp.status != 200:
            await client.raise_for(resp, relay=True)
        async for line in client.lines(resp):  # to the end: the connection is reused
            if finished or not line.strip():
                continue
            obj = parse_json_line(line, client.label)
            if (adapter_error := relayed_adapter_error(obj.get("error"))) is not None:
                raise adapter_error
            if (error := stream_error(obj, client.label)) is not None:
                raise error
            try:
                chunk = GenChunk.from_dict(obj)
            except ValueError as e:
                log.warning("%s: invalid chunk %r: %s", client.label, obj, e)
                raise BackendError(f"{client.label} sent an invalid chunk") from e
            finished = chunk.finish_reason is not None
            yield chunk
        if not finished:
            raise BackendError(f"{client.label} ended the stream before the request finished")
    except (asyncio.CancelledError, GeneratorExit):  # the caller left: before the close
        if progress is not None and not finished:
            await stop_and_count(client, req.request_id, progress)
        raise
    finally:
        if finished:
            resp.release()  # complete: the connection goes back to the pool
        else:
            resp.close()  # the worker sees the connection close and aborts the request


async def check_adapter(client: UpstreamClient, ref: AdapterRef) -> None:
    """The worker's engine validates the adapter; its BadRequestError's words come back."""
    url = client.endpoint.root + "/kvgate/v1/adapters/check"
    await client.json("POST", url, ref.to_dict(), relay=True)


async def remove_adapter(client: UpstreamClient, name: str) -> None:
    url = client.endpoint.root + "/kvgate/v1/adapters/" + quote(name, safe="")
    await client.json("DELETE", url, relay=True)


_STAT_TYPES = typing.get_type_hints(BackendStats)


def parse_stats(data: Any, name: str, label: str) -> BackendStats:
    """A worker's /kvgate/v1/stats (BackendStats as a dict) under this replica's name."""
    if not isinstance(data, dict):
        raise BackendError(f"{label} sent stats that are not a JSON object")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(BackendStats):
        if f.name == "name" or f.name not in data:
            continue
        v, hint = data[f.name], _STAT_TYPES[f.name]
        if hint is bool:
            ok = isinstance(v, bool)
        elif hint is int:
            ok = _is_int(v)
        elif hint is float:
            ok = _is_int(v) or isinstance(v, float)
        else:  # extra
            ok = isinstance(v, dict)
        if not ok:
            raise BackendError(f"{label} sent invalid stats ({f.name})")
        values[f.name] = v
    return BackendStats(name=name, **values)


class WorkerEvents:
    """The KV events read from one worker, renamed to this replica, and the blocks it
    holds as far as they tell (so a resync can report the ones gone as removed)."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.epoch = ""  # none yet: the first poll is a resync
        self.seq = 0
        self.held: set[tuple[str, str]] = set()  # (medium, block hash)
        self._pending: list[KVEvent] = []

    def take(self) -> list[KVEvent]:
        events, self._pending = self._pending, []
        return events

    def apply(self, reply: Any, label: str) -> None:
        """One long poll's reply: `{"epoch", "seq", "resync", "events"}`."""
        r = reply if isinstance(reply, dict) else {}
        if not (
            isinstance(r.get("epoch"), str)
            and _is_int(r.get("seq"))
            and isinstance(r.get("resync"), bool)
            and isinstance(r.get("events"), list)
        ):
            raise BackendError(f"{label} sent an invalid KV events reply")
        try:
            events = [KVEvent.from_dict(e) for e in r["events"]]
        except ValueError as e:
            raise BackendError(f"{label} sent an invalid KV event") from e
        if any(e.kind not in ("stored", "removed") or e.medium not in KV_MEDIA for e in events):
            raise BackendError(f"{label} sent a KV event of an unknown kind or medium")
        if r["resync"]:
            kept = {(e.medium, e.block_hash) for e in events if e.kind == "stored"}
            now = time.time()
            self._pending += [
                KVEvent("removed", self.replica, h, None, None, 0, now, medium)
                for medium, h in self.held - kept
            ]
            self.held = set()
        for e in events:
            if e.kind == "stored":
                self.held.add((e.medium, e.block_hash))
            else:
                self.held.discard((e.medium, e.block_hash))
            self._pending.append(dataclasses.replace(e, replica=self.replica))
        self.epoch, self.seq = r["epoch"], r["seq"]


def worker_block_hashes(
    worker: WorkerInfo,
    token_ids: list[int],
    cache_salt: str | None,
    shared_prefix_len: int,
    adapter: AdapterRef | None,
    images: list[ImageInput] | None,
) -> list[str]:
    """As the worker's engine keys its cache: under the adapter's chain root, an image's
    placeholder blocks keyed by its digest; none where it sends no prefix events."""
    if not worker.prefix_events or not worker.block_size:
        return []
    keys = None
    if images and worker.image_token_id is not None:
        try:
            digests = [im.digest for im in images]
            keys = image_key_spans(token_ids, worker.image_token_id, digests)
        except BadRequestError:  # placeholders that do not pair: the worker refuses it
            return []
    root = adapter_root(adapter)
    hashes = hash_blocks(
        token_ids, worker.block_size, cache_salt, shared_prefix_len, root, extra_keys=keys
    )
    return [h.hex() for h in hashes]
