"""Which sequences a step decodes when requests run under LoRA adapters.

llama.cpp applies adapters to a whole context, so one decode runs one adapter set. As
llama-server does, a step decodes the sequences of one group only: those under one
adapter, or those under the base model. Unlike llama-server (which batches the slots
that match the first one it finds), the groups take turns, round robin in the order
they first appeared: with k groups busy each gets every k-th step, so an adapter with
one request is not starved by another with many, nor the base model by either. A group
alone decodes every step, as without adapters.
"""

from __future__ import annotations

from collections.abc import Iterable

from backend_local.lora import AdapterCache, GroupKey, group_key
from backend_local.requests import Request
from backend_local.slots import Slot
from engine_api.errors import AdapterLoadError, BadRequestError


class GroupTurns:
    """The group the next step decodes: round robin over the groups with busy
    sequences, in the order they first appeared."""

    def __init__(self) -> None:
        self._order: list[GroupKey] = []
        self._last: GroupKey = None
        self._started = False

    def pick(self, keys: Iterable[GroupKey]) -> GroupKey:
        present = list(dict.fromkeys(keys))
        assert present, "pick() needs a busy group"
        # the last group stays in the order while we look for the one after it
        kept = [k for k in self._order if k in present or (self._started and k == self._last)]
        order = kept + [k for k in present if k not in kept]
        at = order.index(self._last) + 1 if self._started and self._last in order else 0
        choice = next(k for k in order[at:] + order[:at] if k in present)
        self._order = [k for k in order if k in present]
        self._last, self._started = choice, True
        return choice


class LoraGroups:
    """The worker's side of adapters: loading a request's at admission, picking the
    group a step decodes and setting its adapter on the context, freeing the unused."""

    def __init__(self, cache: AdapterCache) -> None:
        self.cache = cache
        self.turns = GroupTurns()

    @staticmethod
    def running(slots: list[Slot]) -> set[GroupKey]:
        return {group_key(s.adapter) for s in slots if s.request is not None}

    def load(self, request: Request) -> bool:
        """Have the request's adapter loaded; False (the request ended with an
        AdapterLoadError: its file was checked at registration, so what fails now is the
        file, not the request) if it cannot be."""
        if request.adapter is None:
            return True
        try:
            self.cache.acquire(request.adapter)
        except BadRequestError as exc:
            request.emit(AdapterLoadError(request.adapter.name, str(exc)))
            return False
        return True

    def trim(self, slots: list[Slot]) -> None:
        self.cache.trim(self.running(slots))

    def this_turn(self, busy: list[Slot]) -> list[Slot]:
        """The busy slots this step decodes, their adapter set on the context."""
        oldest_first = sorted(busy, key=lambda s: s.request.arrival)
        key = self.turns.pick(group_key(s.adapter) for s in oldest_first)
        self.cache.apply(key)
        return [s for s in busy if group_key(s.adapter) == key]

    def remove(self, name: str, slots: list[Slot]) -> list[Slot] | None:
        """Free the adapters named `name`; the idle slots holding cells computed under
        them (to drop: a file of that name and path may change), or None while a
        request still runs under one."""
        if not self.cache.remove(name, self.running(slots)):
            return None
        return [
            s
            for s in slots
            if s.request is None and s.adapter is not None and s.adapter.name == name
        ]
