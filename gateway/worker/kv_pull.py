"""A decode worker's side of prefill and decode on different workers (the prefill
worker's side is kv_export.py).

Before a request with `kv_source` is generated, its blocks are pulled from that worker
(POST /kvgate/v1/kv/export) and handed to the engine. The decode worker pulls, rather
than the prefill worker pushing, so that the blocks arrive where and when the request
that needs them is, over a connection of the decode side's own, with no state kept on
the prefill side. Any failure of the pull (refused, unreachable, past the time bound, a
body cut short, records the engine does not take) only means the prompt is computed
here: the client sees a slower first token, never an error. Pulls and fallbacks are
counted into the worker's stats (BackendStats.extra, then /metrics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import aiohttp

from engine_api.errors import BackendError, BadRequestError
from engine_api.records import GenRequest
from gateway.backends import Backend
from gateway.backends.kv_transfer import KVTransferBackend, unpack_records
from gateway.backends.remote_images import request_body

log = logging.getLogger("kvgate.worker")
EXPORT_PATH = "/kvgate/v1/kv/export"
DEFAULT_PULL_TIMEOUT_S = 10.0


@dataclass
class PullCounts:
    """What BackendStats.extra says of the pulls (and /metrics after it)."""

    kv_transfers: int = 0  # pulls that brought blocks the engine took
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_fallbacks: int = 0  # pulls that failed: the prompt computed here


class KVPuller:
    def __init__(self, token: str | None, timeout_s: float = DEFAULT_PULL_TIMEOUT_S) -> None:
        self.token = token  # workers paired by one gateway share its worker token
        self.timeout_s = timeout_s
        self.counts = PullCounts()
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def stats(self) -> dict[str, float]:
        return dataclasses.asdict(self.counts)

    async def pull(self, backend: Backend, req: GenRequest) -> None:
        """Take `req.kv_source`'s blocks of `req`'s prompt into `backend`'s engine, or
        count a fallback and leave the prompt to be computed; never raises."""
        source = req.kv_source
        assert source is not None
        start = time.perf_counter()
        try:
            if not isinstance(backend, KVTransferBackend):
                raise BadRequestError("this backend does not take KV blocks")
            async with asyncio.timeout(self.timeout_s):
                body = await self._fetch(source, dataclasses.replace(req, kv_source=None))
                records = unpack_records(body)
                taken = await backend.import_kv(req, records)
            if not taken:  # nothing there (another salt's blocks), or nothing usable
                raise ValueError(f"no block taken of the {len(records)} sent")
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, BackendError) as e:
            self.counts.kv_transfer_fallbacks += 1
            log.warning(
                "request %s: no KV blocks from %s (%s); computing its prompt here",
                *(req.request_id, source, str(e) or type(e).__name__),
            )
            return
        self.counts.kv_transfers += 1
        self.counts.kv_transfer_bytes += len(body)
        self.counts.kv_transfer_seconds += time.perf_counter() - start

    async def _fetch(self, source: str, req: GenRequest) -> bytes:
        if self._http is None:
            self._http = aiohttp.ClientSession(auto_decompress=False)
        headers = {} if self.token is None else {"Authorization": f"Bearer {self.token}"}
        url = source.rstrip("/") + EXPORT_PATH
        body = await request_body(req)  # its images' pixels: encoded off the loop
        if isinstance(body, bytes):
            sent = {"data": body, "headers": headers | {"Content-Type": "application/json"}}
        else:
            sent = {"json": body, "headers": headers}
        async with self._http.post(url, allow_redirects=False, **sent) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            return await resp.read()
