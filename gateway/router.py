"""Model -> backend. Picks the least loaded healthy backend serving the model."""

from __future__ import annotations

from gateway.backends import Backend, BackendError, ModelCard


class Router:
    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self.cards: dict[str, ModelCard] = {}
        self.serving: dict[str, list[Backend]] = {}
        self.broken: dict[str, str] = {}  # backend name -> why it is down

    def add_models(self, backend: Backend) -> None:
        for card in backend.models():
            self.cards.setdefault(card.id, card)
            self.serving.setdefault(card.id, []).append(backend)

    def card(self, model: str) -> ModelCard | None:
        return self.cards.get(model)

    def pick(self, model: str) -> Backend:
        candidates = [b for b in self.serving.get(model, []) if b.name not in self.broken]
        if len(candidates) == 1 and candidates[0].stats().healthy:
            return candidates[0]
        healthy = [b for b in candidates if b.stats().healthy]
        if not healthy:
            reasons = "; ".join(self.broken.values()) or "no healthy backend"
            raise BackendError(f"no backend can serve {model!r} right now ({reasons})")
        return min(healthy, key=_load)


def _load(backend: Backend) -> tuple[int, float]:
    s = backend.stats()
    return (s.running + s.waiting, s.kv_usage)
