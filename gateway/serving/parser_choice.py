"""Which output parsers (gateway.parsers) read a backend's replies: the ones its entry
names (`reasoning_parser` / `tool_call_parser`, or `kvgate serve`'s flags of the same
names), else the ones its model's chat template and config call for (`detect`), else none.

Chosen once per backend, the first time it is asked, and kept in the GatewayState (a
reload's backends are new objects, chosen again). Detection needs the model's template: the in-process engines give it
(gateway.backends.base.ChatTemplateBackend: the HF directory's tokenizer_config and
config.json, a GGUF's tokenizer.chat_template and general.architecture); the fake
backend has none, and a remote upstream parses its own replies (vLLM, SGLang) where it
renders the chat itself, so both parse nothing unless their entry says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.backends import Backend, BackendSpec, ModelCard
from gateway.backends.base import ChatTemplateBackend
from gateway.backends.capabilities import supports
from gateway.parsers import detect

if TYPE_CHECKING:  # a worker imports this module, and gateway.state is the database's
    from gateway.state import GatewayState

log = logging.getLogger("kvgate")


@dataclass(frozen=True)
class Parsers:
    reasoning: str | None = None
    tools: str | None = None
    source: str = "none"  # "configured", "detected" or "none"

    def describe(self) -> dict[str, str | None]:
        """As /v1/models' `kvgate` object says it."""
        return {
            "reasoning_parser": self.reasoning,
            "tool_call_parser": self.tools,
            "parsers_from": self.source,
        }

    def line(self) -> str:
        """As the start-up line says it."""
        return (
            f"{self.source}: reasoning parser {self.reasoning or 'none'}, "
            f"tool-call parser {self.tools or 'none'}"
        )


NONE = Parsers()


def parsers_of(gw: GatewayState, backend: Backend) -> Parsers:
    """The backend's parsers, chosen on the first ask (a models directory's model's once
    it is up: its template is read from its engine)."""
    chosen = gw.parser_choices.get(backend)
    if chosen is None and gw.models_dir is not None and gw.models_dir.not_up(backend):
        return NONE
    if chosen is None:
        chosen = gw.parser_choices[backend] = _choose(spec_of(gw, backend), backend)
    return chosen


def parsers_of_card(gw: GatewayState, card: ModelCard) -> Parsers:
    """The parsers of the backend whose card this is (/v1/models says them)."""
    backend = next((b for b in gw.backends if b.name == card.backend), None)
    return NONE if backend is None else parsers_of(gw, backend)


def _choose(spec: BackendSpec | None, backend: Backend) -> Parsers:
    reasoning = spec.reasoning_parser if spec is not None else None
    tools = spec.tool_call_parser if spec is not None else None
    if reasoning and tools:
        return Parsers(reasoning, tools, "configured")
    found: tuple[str | None, str | None] = (None, None)
    if supports(backend, ChatTemplateBackend):
        try:
            found = detect(*backend.chat_template_info())
        except Exception:  # a model the engine serves must not fail on this
            log.exception("detecting the output parsers of backend %s failed", backend.name)
    if not (found[0] or found[1]):
        given = reasoning or tools
        return Parsers(reasoning, tools, "configured") if given else NONE
    return Parsers(reasoning or found[0], tools or found[1], "detected")


def spec_of(gw: GatewayState, backend: Backend) -> BackendSpec | None:
    """The entry that made `backend` (one of its replicas, or its workers')."""
    entry = next((name for name, bs in gw.entries.items() if backend in bs), None)
    if entry is None:  # a models directory's, or none
        return None if gw.models_dir is None else gw.models_dir.spec_of(backend)
    specs = gw.settings.resolved_backends(starter=True)
    return next((s for s in specs if s.name == entry), None)
