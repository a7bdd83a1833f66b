"""The room built and its runner started, once the gateway's state is (gateway.app)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gateway.batches.files import FileStore, files_dir
from gateway.batches.runner import BatchRunner, Execute
from gateway.state import GatewayState


@dataclass
class Batches:
    files: FileStore
    runner: BatchRunner


BATCHES = web.AppKey("batches", Batches)


def start_batches(gw: GatewayState, execute: Execute) -> Batches:
    files = FileStore(gw.db, files_dir(gw.settings))
    files.open()
    runner = BatchRunner(gw, files, execute)
    runner.start()
    return Batches(files, runner)
