"""The models of a models directory, loaded on demand: one entry per model (llama.cpp's
for a GGUF file, the gpu backend's for a Hugging Face directory),
known to the router (listed, its card's) from the start but started only by the first
request that needs it, and stopped again when the directory's caps want its room or its
keep-alive has run out.

A request holds its model (`held`) from before it is rendered until it is placed; the
router's count of requests in flight holds it from there to its end. A held model is
busy and never unloaded under it. Its first request waits for the load, which runs in a
thread (the engine's construction, as a configured entry's start): other models, and
the event loop, go on meanwhile; requests arriving during the load wait for the same
one. A load that fails is a 503 saying why, and the next request tries again.

Keep-alive is Ollama's: each request sets how long its model stays after it (the
request's `keep_alive`, else the gateway's), counted from the model's last use; 0
unloads it once its requests are done, negative keeps it. A sweep every SWEEP_S unloads
those past it, and reads the directory again (files added, removed or replaced appear,
go or are reloaded; so does POST /admin/reload at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway.backends import Backend, BackendSpec, build_backend
from gateway.config import Settings
from gateway.config_backends import with_kv_tier_secret
from gateway.config_check import keep_alive_s
from gateway.http.errors import ApiError
from gateway.ondemand import files
from gateway.ondemand.budget import NoRoom, Resident, make_room, memory_budget
from gateway.ondemand.scan import Found, scan
from gateway.routing.fair_queue import FairQueue
from gateway.state import GatewayState

log = logging.getLogger("kvgate")
SWEEP_S = 1.0  # how often expired models are unloaded and the directory read again
DEFAULT = "default"  # a request that names no keep_alive: the gateway's
UNCHANGED = "unchanged"  # a hold inside another's: the outer one sets the keep-alive
KeepAlive = float | None | str  # seconds, None (forever), DEFAULT or UNCHANGED


@dataclass
class Entry:
    """One file's model and where it stands."""

    found: Found
    backend: Backend
    spec: BackendSpec
    loaded: bool = False
    loading: asyncio.Task | None = None
    stopping: asyncio.Task | None = None
    holds: int = 0
    last_used: float = 0.0  # wall clock: /api/ps shows the expiry as a time
    keep_alive: float | None = 300.0
    load_s: float = 0.0  # the last load's duration


@dataclass(frozen=True)
class Held:
    """What a request's hold tells it: how long it waited for its model's load."""

    waited_ns: int = 0


@dataclass
class Scanned:
    """What reading the directory again changed."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class ModelsDir:
    def __init__(self, gw: GatewayState, settings: Settings) -> None:
        self.gw = gw
        self.directory = settings.models_dir
        self.models_max = settings.models_max
        self.budget = memory_budget(settings.models_memory_gb)
        self.keep_alive = keep_alive_s(settings.keep_alive)
        self.options = {kind: settings.dir_options(kind) for kind in ("local", "gpu")}
        self.parsers = (settings.reasoning_parser, settings.tool_call_parser)
        self.entries: dict[str, Entry] = {}
        self._room = asyncio.Lock()  # one decision at a time on what is resident
        self._scan = asyncio.Lock()
        self._sweeper: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Read the directory (OSError: it cannot be read) and start the sweep."""
        await self.rescan()
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        """Stop the sweep and every loaded model (the gateway has drained)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for entry in self.entries.values():
            await self._stopped(entry)

    # -- what the routes ask

    def has(self, model: str) -> bool:
        return model in self.entries

    def owns(self, backend: Backend) -> bool:
        return any(e.backend is backend for e in self.entries.values())

    def not_up(self, backend: Backend) -> bool:
        """One of this directory's models whose engine is not running now."""
        entry = next((e for e in self.entries.values() if e.backend is backend), None)
        return entry is not None and not self.is_up(entry.found.name)

    def spec_of(self, backend: Backend) -> BackendSpec | None:
        return next((e.spec for e in self.entries.values() if e.backend is backend), None)

    def is_loaded(self, model: str) -> bool:
        """Resident: loaded, or loading (it counts against the caps from the start)."""
        entry = self.entries.get(model)
        return entry is not None and entry.loaded

    def is_up(self, model: str) -> bool:
        """Loaded, its engine running (its tokenizer and template can be read)."""
        entry = self.entries.get(model)
        return entry is not None and entry.loaded and entry.loading is None

    def expires_at(self, model: str) -> float | None:
        """When the loaded `model` unloads if unused (wall clock); None: never."""
        entry = self.entries[model]
        if entry.keep_alive is None:
            return None
        return max(entry.last_used, time.time() if self._busy(entry) else 0) + entry.keep_alive

    def unload(self, model: str) -> None:
        """Ollama's keep_alive 0 with nothing to generate: unloaded now if idle, else once
        its requests are done."""
        entry = self.entries[model]
        entry.keep_alive = 0
        if entry.loaded and not self._busy(entry):
            self._unload(entry)

    @contextlib.asynccontextmanager
    async def held(self, model: str, keep_alive: KeepAlive = UNCHANGED) -> AsyncIterator[Held]:
        """`model` loaded and kept loaded while held; on leaving, `keep_alive` applies
        from now (0: unloaded at once if nothing else holds it)."""
        entry = self.entries.get(model)
        if entry is None:  # a configured model, or one this directory no longer has
            yield Held()
            return
        entry.holds += 1
        try:
            started = time.monotonic_ns()
            waited = await self._ensure(entry)
            yield Held(time.monotonic_ns() - started if waited else 0)
        finally:
            entry.holds -= 1
            entry.last_used = time.time()
            if keep_alive != UNCHANGED:
                entry.keep_alive = self.keep_alive if keep_alive == DEFAULT else keep_alive  # type: ignore[assignment]
            if entry.keep_alive == 0 and entry.loaded and not self._busy(entry):
                self._unload(entry)

    # -- loading and unloading

    async def _ensure(self, entry: Entry) -> bool:
        """Wait until the entry's model is loaded; True if it was not."""
        if entry.stopping is not None:
            await asyncio.shield(entry.stopping)
        if entry.loaded and entry.loading is None:
            return False
        async with self._room:
            if entry.loading is None and not entry.loaded:
                await self._make_room(entry)
                entry.loaded = True  # resident from now: counted by the next decision
                entry.loading = asyncio.create_task(self._load(entry))
            task = entry.loading
        assert task is not None
        await asyncio.shield(task)  # a request that gives up does not stop the load
        return True

    async def _make_room(self, entry: Entry) -> None:
        resident = [
            Resident(e.found.name, e.found.size, e.last_used, self._busy(e))
            for e in self.entries.values()
            if e.loaded and e is not entry
        ]
        try:
            leaving = make_room(
                entry.found.name, entry.found.size, resident, self.models_max, self.budget
            )
        except NoRoom as e:
            raise ApiError(503, str(e), code="model_not_loaded") from None
        for name in leaving:
            log.info("models directory: unloading %s to load %s", name, entry.found.name)
            self._unload(self.entries[name])
            await self._stopped(self.entries[name])

    async def _load(self, entry: Entry) -> None:
        name, started = entry.found.name, time.monotonic()
        try:
            await entry.backend.start()
        except Exception as e:
            entry.loaded = False
            # why, for the operator: it names the server's paths, which a client is not told
            log.warning("models directory: %s failed to load: %s", name, e)
            log.debug("models directory: %s failed to load", name, exc_info=True)
            with contextlib.suppress(Exception):
                await entry.backend.stop(drain=False)
            why = f"model {name!r} failed to load (the gateway's log says why)"
            raise ApiError(503, why, code="model_not_loaded") from None
        finally:
            entry.loading = None
        entry.load_s = time.monotonic() - started
        entry.last_used = time.time()
        router, backend = self.gw.router, entry.backend
        router.cards[name] = next(c for c in backend.models() if c.id == name)
        slots = getattr(backend, "max_in_flight", None)
        if slots is not None and backend.name not in self.gw.queues:
            self.gw.queues[backend.name] = FairQueue(slots, self.gw.settings.fairness or "vtc")
        log.info("models directory: loaded %s in %.2f s", name, entry.load_s)

    def _unload(self, entry: Entry) -> None:
        """Unloaded from now on (/api/ps no longer shows it); the engine stops behind."""
        if not entry.loaded or entry.loading is not None:
            return
        entry.loaded = False
        entry.stopping = asyncio.create_task(self._stop_engine(entry))

    async def _stop_engine(self, entry: Entry) -> None:
        try:
            await entry.backend.stop(drain=True)
            log.info("models directory: unloaded %s", entry.found.name)
        except Exception:
            log.exception("models directory: %s failed to stop", entry.found.name)
        finally:
            entry.stopping = None

    async def _stopped(self, entry: Entry) -> None:
        if entry.loaded and entry.loading is None:
            self._unload(entry)
        if entry.stopping is not None:
            await asyncio.shield(entry.stopping)

    def _busy(self, entry: Entry) -> bool:
        return entry.holds > 0 or self.gw.router.in_flight.get(entry.backend.name, 0) > 0

    # -- the directory's files (Ollama's /api/copy, /api/create, /api/delete)

    async def copy(self, source: str, destination: str) -> None:
        """`destination` a new model of `source`'s file; FileError if it cannot be."""
        entry = self._entry(source)
        await asyncio.to_thread(files.copy, self.directory, entry.found, destination)
        await self.rescan()

    async def delete(self, model: str) -> None:
        """The model's file removed, and the model with it (once its requests are done)."""
        entry = self._entry(model)
        await asyncio.to_thread(files.delete, self.directory, entry.found)
        await self.rescan()

    def _entry(self, model: str) -> Entry:
        entry = self.entries.get(model)
        if entry is None:
            raise files.FileError(404, f"model '{model}' not found in the models directory")
        return entry

    # -- the sweep and the directory

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self.sweep()
                await self.rescan()
            except Exception:  # a directory gone for a moment: the next sweep tries again
                log.warning("models directory %s: cannot be read", self.directory, exc_info=True)

    def sweep(self) -> None:
        """Unload the idle models whose keep-alive has run out."""
        now = time.time()
        for entry in self.entries.values():
            if self._busy(entry):  # a stream placed long ago counts as use until it ends
                entry.last_used = now
                continue
            ka = entry.keep_alive
            if entry.loaded and ka is not None and now >= entry.last_used + ka:
                self._unload(entry)

    async def rescan(self) -> Scanned:
        """Read the directory again: new files served, gone ones removed (stopped once
        their requests are done), changed ones replaced."""
        async with self._scan:
            found = await asyncio.to_thread(scan, self.directory)
            done = Scanned()
            for name, entry in list(self.entries.items()):
                if found.get(name) != entry.found:
                    self._remove(entry)
                    done.removed.append(name)
            for name, f in found.items():
                if name not in self.entries and self._add(f):
                    done.added.append(name)
            # a file replaced is both; say it once, as added
            done.removed = [n for n in done.removed if n not in done.added]
            if done.added or done.removed:
                log.info("models directory: added %s, removed %s", done.added, done.removed)
            return done

    def _add(self, found: Found) -> bool:
        gw = self.gw
        served = gw.router.serving.get(found.name, [])
        if any(not self.owns(b) for b in served):
            log.warning("models directory: %s is served by the config already", found.name)
            return False
        reasoning, tools = self.parsers
        options = dict(self.options[found.kind])
        if found.mmproj is not None:  # its vision projector (scan pairs one only with a GGUF)
            options["mmproj"] = found.mmproj
        spec = BackendSpec(
            f"dir-{found.name}",
            found.kind,
            found.path,
            found.name,
            options,
            reasoning_parser=reasoning,
            tool_call_parser=tools,
        )
        backend = build_backend(with_kv_tier_secret(spec, gw.kv_tier_secret))
        self.entries[found.name] = Entry(found, backend, spec, keep_alive=self.keep_alive)
        gw.backends.append(backend)
        gw.backend_types[backend.name] = found.kind
        gw.router.backends.append(backend)
        gw.router.add_models(backend)
        if found.kind == "local":  # its context before it loads: the engine's settings say it
            card = gw.router.cards[found.name]
            card.context_length = _llama_context(found.path, spec.options)
            card.vision = found.mmproj is not None  # an image's chat may load it
        return True

    def _remove(self, entry: Entry) -> None:
        gw, backend = self.gw, entry.backend
        del self.entries[entry.found.name]
        gw.router.remove([backend])
        gw.backends[:] = [b for b in gw.backends if b is not backend]
        gw.queues.pop(backend.name, None)
        task = asyncio.create_task(self._retire(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retire(self, entry: Entry) -> None:
        """A removed file's model stops once its requests are done (or the drain timeout)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.gw.settings.drain_timeout_s
        while self._busy(entry) and loop.time() < end:
            await asyncio.sleep(0.05)
        if entry.loading is not None:
            with contextlib.suppress(Exception):
                await entry.loading
        await self._stopped(entry)


def _llama_context(path: str, options: dict[str, Any]) -> int:
    """A llama.cpp model's context per request, as its engine will hold it (0 where the
    options do not make a config: its load says why)."""
    from backend_local import EngineConfig  # lazily: llama.cpp's, as the adapter is

    try:
        return EngineConfig(model_path=path, **options).n_ctx_per_seq
    except (TypeError, ValueError):
        return 0


def of(gw: GatewayState) -> ModelsDir | None:
    """The gateway's models directory, if it serves one."""
    models_dir: Any = gw.models_dir
    return models_dir


def held(gw: GatewayState, model: str, keep_alive: KeepAlive = UNCHANGED) -> Any:
    """`ModelsDir.held` where the gateway has a models directory holding `model`; a
    hold of nothing else."""
    models_dir = of(gw)
    if models_dir is None or not models_dir.has(model):
        return _NOTHING
    return models_dir.held(model, keep_alive)


# the hold of a model no directory loads: one shared context that does nothing (every
# request takes two holds; a generator-based one cost each a few microseconds)
_NOTHING = contextlib.nullcontext(Held())
