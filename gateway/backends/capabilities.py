"""What a backend can do beyond the Backend protocol (reports its prefix cache, counts
an upstream's output, serves LoRA adapters, embeds), decided once per adapter class.

`isinstance` against a runtime-checkable Protocol walks every member of the protocol
on each call: 30 to 50 us on Python 3.11, and a request asked it several times, about a
sixth of what the gateway spends on a request. An adapter's capabilities are its class's
(its methods; the data members the protocols name are set by every adapter's
constructor), so the first answer for a class stands for all its instances.
"""

from __future__ import annotations

from typing import TypeGuard, TypeVar

P = TypeVar("P")

_KNOWN: dict[tuple[type, type], bool] = {}


def supports(backend: object, protocol: type[P]) -> TypeGuard[P]:
    """`isinstance(backend, protocol)`, asked once per class of backend."""
    key = (type(backend), protocol)
    known = _KNOWN.get(key)
    if known is None:
        known = _KNOWN[key] = isinstance(backend, protocol)
    return known
