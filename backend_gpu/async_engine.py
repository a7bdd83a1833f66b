"""Drives the engine from an asyncio loop: the engine steps in a worker thread, and each
request's outputs flow back to its own asyncio queue.

Only the worker thread touches the engine. The loop hands it adds and aborts through a
command queue, applied between steps, so a long step never blocks the event loop. An
idle engine still checks every half second that its other tensor-parallel ranks live,
so one that died makes the engine dead before the next request finds out.

An embedding model (a sentence-transformers directory) gets an EmbeddingEngine in the
LLMEngine's place (embed_engine.py): the same thread and command queue, its requests
added by `embed` and answered once, whole. A model does one or the other: `generate`
on an embedding model, or `embed` on a generator, is a BadRequestError saying which
the model does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from backend_gpu.block_manager import KVCacheEvent
from backend_gpu.config import EngineConfig
from backend_gpu.embed_engine import NOT_A_GENERATOR, EmbeddingEngine
from backend_gpu.engine import LLMEngine
from backend_gpu.outputs import EngineStats, RequestOutput
from backend_gpu.pooling import is_embedding_model
from engine_api.errors import BadRequestError, EngineDeadError
from engine_api.records import (
    EMBED,
    GENERATE,
    AdapterRef,
    EmbedRequest,
    EmbedResult,
    GenRequest,
    Progress,
)
from engine_api.structured import StructuredOutput


class AsyncLLM:
    def __init__(self, model: str, **kwargs) -> None:
        config = EngineConfig(model=model, **kwargs)
        self.task = EMBED if is_embedding_model(os.fspath(model)) else GENERATE
        self.engine: LLMEngine | EmbeddingEngine = (
            EmbeddingEngine(config) if self.task == EMBED else LLMEngine(config)
        )
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = self.engine.stats()
        # the engine thread appends, the loop drains; deque ops are atomic. Bounded so a
        # gateway that never drains them cannot grow it without end (the oldest go).
        self._kv_events: deque[KVCacheEvent] = deque(maxlen=100_000)
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, req: GenRequest, progress: Progress | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's incremental outputs; leaving early aborts it. Bad input
        raises BadRequestError (a ValueError) here, before anything is yielded; an
        adapter whose files would not load, AdapterLoadError.

        `progress` hears how much of the prompt is computed. Leaving early returns once
        the abort is applied, after the step in flight (whose blocks stay cached): then
        `progress` holds all the engine computed for the request."""
        request_id = req.request_id
        outputs = await self._add(request_id, lambda: self.engine.add_request(req, progress))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine failed: {item!r}") from item
                finished = item.finished
                if item.error is not None:  # its adapter would not load: nothing ran
                    raise item.error
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self._abort_applied(request_id)

    async def embed(self, req: EmbedRequest, progress: Progress | None = None) -> EmbedResult:
        """The request's vectors, computed in a step with other queued inputs; `progress`
        hears the tokens of its inputs pooled so far. Leaving early aborts it, once the
        step in flight ends (as `generate`). Bad input raises BadRequestError here."""
        if self.task != EMBED:
            raise BadRequestError("this model generates text; it is not an embedding model")
        outputs = await self._add(req.request_id, lambda: self.engine.add_embed(req, progress))
        finished = False
        try:
            item = await outputs.get()
            finished = True
        finally:
            if not finished:
                await self._abort_applied(req.request_id)
        if isinstance(item, BaseException):
            raise EngineDeadError(f"engine failed: {item!r}") from item
        if item.result is None:  # aborted by a shutdown
            raise EngineDeadError("engine is shut down")
        return item.result

    async def _add(self, request_id: str, add: Callable[[], None]) -> asyncio.Queue:
        """Admit a request in the engine thread (`add` raises for bad input); the queue
        its outputs will arrive on."""
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add_and_listen() -> None:
            add()
            self._outputs[request_id] = (loop, outputs)

        await self._call(add_and_listen)
        return outputs

    async def _abort_applied(self, request_id: str) -> None:
        """Abort a request its caller left, between steps, and return once it is applied
        (at once if the engine is gone: it computes nothing more). Cancelled meanwhile,
        the abort still happens; only the wait ends."""
        with contextlib.suppress(EngineDeadError):
            await self._call(lambda: self._abort(request_id))

    async def check_structured(self, structured: StructuredOutput) -> None:
        """Compile a structured output ahead of its request, in a worker thread (not the
        engine's); BadRequestError if it cannot be. The request finds it compiled."""
        if self.task == EMBED:
            raise BadRequestError(NOT_A_GENERATOR)
        await asyncio.to_thread(self.engine.grammars.compile, structured)

    async def check_adapter(self, ref: AdapterRef) -> None:
        """Accept LoRA adapter `ref` or raise BadRequestError naming the problem; reads
        its files in a worker thread (not the engine's), which the request then finds
        checked."""
        if self.task == EMBED:
            raise BadRequestError(NOT_A_GENERATOR)
        await asyncio.to_thread(self.engine.check_adapter, ref)

    async def remove_adapter(self, name: str) -> None:
        """Forget LoRA adapter `name` once its running requests finish."""
        if self.task == GENERATE:
            await self._call(lambda: self.engine.remove_adapter(name))

    async def export_kv(self, req: GenRequest) -> list[bytes]:
        """Records of the blocks of `req`'s prompt this engine holds, from the first on
        (LLMEngine.export_kv), for a decode worker to import."""
        return await self._call(lambda: self.engine.export_kv(self.engine.prompt_keys(req)))

    async def import_kv(self, req: GenRequest, records: list[bytes]) -> int:
        """Take a prefill worker's records of `req`'s prompt blocks before `req` is
        generated here (LLMEngine.import_kv); how many blocks were taken."""
        return await self._call(
            lambda: self.engine.import_kv(self.engine.prompt_keys(req), records)
        )

    async def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish_reason "abort"); unknown ids are
        ignored."""
        await self._call(lambda: self._abort(request_id))

    def stats(self) -> EngineStats:
        # a copy the engine thread refreshes after each step, with the rates read now: an
        # idle engine takes no step, and its rates must still fall to zero (Throughput is
        # thread-safe)
        prompt, gen = self.engine.throughput.rates()
        return replace(self._stats, prompt_tokens_per_s=prompt, gen_tokens_per_s=gen)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Prefix-cache blocks stored and removed since the last call (needs
        enable_kv_events). Never blocks."""
        events = []
        while self._kv_events:
            events.append(self._kv_events.popleft())
        return events

    async def shutdown(self) -> None:
        self._stopping = True
        self._commands.put((lambda: None, None, None))  # wake the thread
        await asyncio.to_thread(self._thread.join)
        for request_id in list(self._outputs):
            self._abort(request_id)
        self.engine.close()

    # -- engine thread side ---------------------------------------------------------

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error!r}")
        if self._stopping:
            raise EngineDeadError("engine is shut down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((fn, loop, future))
        return await future

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        target = self._outputs.pop(request_id, None)
        if out is not None and target is not None:
            loop, outputs = target
            loop.call_soon_threadsafe(outputs.put_nowait, out)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, loop, future = command
            try:
                result, error = fn(), None
            except Exception as exc:  # bad input: the caller's error, not the engine's
                result, error = None, exc
            if future is not None:
                loop.call_soon_threadsafe(_settle, future, result, error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping or not self.engine.has_unfinished_requests():
                    self.engine.runner.check_alive()
                    self._stats = self.engine.stats()
                    continue
                outs = self.engine.step()
                # events first: a caller that sees its request finish finds its blocks listed
                self._kv_events.extend(self.engine.take_kv_events())
                for out in outs:
                    target = self._outputs.get(out.request_id)
                    if target is None:
                        continue
                    if out.finished:
                        del self._outputs[out.request_id]
                    loop, outputs = target
                    loop.call_soon_threadsafe(outputs.put_nowait, out)
                self._stats = self.engine.stats()
            self._stats = self.engine.stats()
            self._fail_pending(EngineDeadError("engine is shut down"))
        except BaseException as exc:  # the engine is dead: tell every waiting request
            self.error = exc
            for loop, outputs in self._outputs.values():
                loop.call_soon_threadsafe(outputs.put_nowait, exc)
            self._outputs.clear()
            self._fail_pending(EngineDeadError(f"engine failed: {exc!r}"))

    def _fail_pending(self, error: BaseException) -> None:
        while True:
            try:
                _, loop, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                loop.call_soon_threadsafe(_settle, future, None, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
