"""The Files and Batch APIs' room (issue 50): the files' store, the batches' rows and
the runner that serves their lines at the lowest priority. The routes find it under
`BATCHES` on the app; gateway.app starts and stops it with the gateway."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gateway.batches.files import FileStore
from gateway.batches.runner import BatchRunner


@dataclass
class Batches:
    files: FileStore
    runner: BatchRunner


BATCHES = web.AppKey("batches", Batches)
