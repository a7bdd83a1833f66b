"""Which adapters are where: checked (their files accepted), in host memory (up to
max_cpu_loras, least recently used out) and resident in one of the device's max_loras
slots (LoRAStacks; least recently used out, but never one a running sequence uses).

Reading an adapter's tensors from disk is the slow part: a background thread does it,
while the engine keeps stepping the other requests, and the engine thread polls for
what is done. Putting a host copy in a slot (a device copy of a few MB) happens in the
engine thread when the scheduler admits a sequence, between steps, so a slot never
changes under a running step. The engine thread owns every method but `check`, which
only reads files (the async engine runs it in a thread of its own).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from backend_gpu.lora.peft_files import AdapterInfo, AdapterWeights, BaseShapes, inspect, read
from engine_api.errors import BadRequestError
from engine_api.records import AdapterRef


class LoRAManager:
    def __init__(
        self,
        shapes: BaseShapes,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        write_slot: Callable[[int, AdapterWeights | None], None],
    ) -> None:
        self.shapes, self.max_rank, self.max_cpu = shapes, max_rank, max_cpu_loras
        self.write_slot = write_slot
        self._lock = threading.Lock()  # guards `checked`, which `check` fills from any thread
        self.checked: dict[str, AdapterInfo] = {}
        self.host: OrderedDict[str, AdapterWeights] = OrderedDict()
        self.loading: dict[str, Future[AdapterWeights]] = {}
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self.slot_names: list[str | None] = [None] * max_loras
        self.pins = [0] * max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # unpinned resident slots
        self.doomed: set[int] = set()  # slots removed while in use: cleared at the last release
        self.loads = 0  # adapters put in a slot so far

    def check(self, ref: AdapterRef) -> AdapterInfo:
        """Accept `ref`'s files (cached by name) or raise BadRequestError naming why."""
        with self._lock:
            known = self.checked.get(ref.name)
        if known is not None:
            if known.ref.path != ref.path:
                raise BadRequestError(
                    f"adapter {ref.name!r} is loaded from {known.ref.path}, not {ref.path}: "
                    "remove it first"
                )
            return known
        info = inspect(ref, self.shapes, self.max_rank)
        with self._lock:
            return self.checked.setdefault(ref.name, info)

    def resident(self) -> list[str]:
        return [name for name in self.slot_names if name is not None]

    def ready(self, name: str) -> bool:
        """Whether a sequence of adapter `name` may be queued: its weights are at hand."""
        return name in self.host or name in self.slot_names

    def start_loading(self, ref: AdapterRef) -> None:
        """Read `ref`'s tensors in the background unless they are at hand or on the way."""
        if self.ready(ref.name) or ref.name in self.loading:
            return
        self.loading[ref.name] = self.reader.submit(self._read, ref)

    def _read(self, ref: AdapterRef) -> AdapterWeights:
        """`ref`'s tensors, its files checked again as they are now (they may have
        changed since `check` accepted them: what is read is what is checked), or the
        error that says why not (also if it was removed meanwhile)."""
        self.check(ref)
        return read(inspect(ref, self.shapes, self.max_rank), self.shapes)

    def poll(self, wanted: set[str]) -> dict[str, BaseException | None]:
        """The reads finished since the last call: name -> None, or the error it raised.
        `wanted`: the adapters of the queued requests, whose host copies are kept."""
        done: dict[str, BaseException | None] = {}
        for name, future in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[name]
            error = future.exception()
            done[name] = error
            if error is None and self._current(future.result().info):
                self._keep_on_host(future.result(), wanted)
        return done

    def _current(self, info: AdapterInfo) -> bool:
        """Whether `info`'s adapter is still what its name means (not removed, nor
        registered again from another path, while it was read)."""
        with self._lock:
            known = self.checked.get(info.ref.name)
        return known is not None and known.ref == info.ref

    def wait(self, timeout: float) -> None:
        """Block until some read finishes (or `timeout` seconds): nothing else to run."""
        futures.wait(list(self.loading.values()), timeout, futures.FIRST_COMPLETED)

    def _keep_on_host(self, weights: AdapterWeights, wanted: set[str]) -> None:
        """Keep `weights`, pushing out the least recently used copies beyond max_cpu; but
        never a queued request's (its read would start over, and with a small cache
        two requests could push each other's adapter out forever): while more adapters
        than max_cpu are queued, host memory holds them all."""
        name = weights.info.ref.name
        self.host[name] = weights
        self.host.move_to_end(name)
        spare = [n for n in self.host if n not in wanted and n != name]
        for victim in spare[: max(0, len(self.host) - self.max_cpu)]:
            del self.host[victim]

    def acquire(self, ref: AdapterRef) -> int | None:
        """A slot holding `ref`, pinned for one more running sequence; None when it is not
        at hand yet (its read is started) or every slot is pinned by other adapters."""
        name = ref.name
        if name in self.slot_names:
            slot = self.slot_names.index(name)
        elif name not in self.host:
            self.start_loading(ref)
            return None
        else:
            free = [i for i, n in enumerate(self.slot_names) if n is None and not self.pins[i]]
            if free:
                slot = free[0]
            elif self.slot_lru:
                slot, _ = self.slot_lru.popitem(last=False)
            else:
                return None
            self.write_slot(slot, self.host[name])
            self.host.move_to_end(name)
            self.slot_names[slot] = name
            self.loads += 1
        self.pins[slot] += 1
        self.slot_lru.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """A running sequence on `slot` finished or was preempted."""
        self.pins[slot] -= 1
        if self.pins[slot]:
            return
        if slot in self.doomed:
            self.doomed.discard(slot)
            self.write_slot(slot, None)
        else:
            self.slot_lru[slot] = None

    def remove(self, name: str) -> None:
        """Forget `name`: its host copy now, its slot once no running sequence uses it."""
        with self._lock:
            self.checked.pop(name, None)
        self.host.pop(name, None)
        if name not in self.slot_names:
            return
        slot = self.slot_names.index(name)
        self.slot_names[slot] = None  # not found again, nor handed out while pinned
        if self.pins[slot]:
            self.doomed.add(slot)
        else:
            self.slot_lru.pop(slot, None)
            self.write_slot(slot, None)

    def close(self) -> None:
        self.reader.shutdown(wait=False, cancel_futures=True)
