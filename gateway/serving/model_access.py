"""The model a request names, resolved for its principal: its tenant, its card, whether it may use
it and whether the model does the task asked.

Apart from admission because routes that admit nothing ask them too: /tokenize and
/detokenize (`model_card`), files and batches (`tenant_of`), the prefix routes
(`require_task`); completions (gateway.serving.admission) and embeddings
(gateway.serving.embedding) both open with `loaded`.

A LoRA adapter's name (gateway.routing.adapters) is a model to the client: its card and its
replicas are its base model's (`served_model`), while the allowed models name the adapter.
"""

from __future__ import annotations

from typing import Any

from engine_api.records import AdapterRef
from gateway.backends import EMBED, GENERATE, ModelCard
from gateway.http.errors import ApiError
from gateway.ondemand import DEFAULT, held
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal


def loaded(gw: GatewayState, principal: Principal, model: str) -> Any:
    """The hold that keeps `model` loaded (a models directory's: gateway.ondemand) while a
    request is served on it, taken after a 404 or 403 has had its say: a request that may not
    use the model loads nothing. Enter it with `async with`."""
    tenant_of(principal)  # a 404 or 403 before anything loads
    model_card(gw, principal, model)
    return held(gw, served_model(gw, principal, model), DEFAULT)


def model_card(gw: GatewayState, principal: Principal, model: str) -> ModelCard:
    """The model's card (an adapter's: its base model's), if it exists for the principal's
    tenant and it may use it; else a 404 or 403 that says what it may use. Another
    tenant's adapter is as unknown as a model that does not exist."""
    card = gw.router.card(served_model(gw, principal, model))
    if card is None:
        # name what this tenant can use instead (GET /v1/models lists the same)
        adapters = [a.name for a in gw.adapters.usable(principal.tenant_id)]
        names = [*gw.router.cards, *adapters]
        usable = ", ".join(m for m in names if principal.may_use(m)) or "none"
        raise ApiError(
            404, f"The model `{model}` does not exist. Available: {usable}.", code="model_not_found"
        )
    if not principal.may_use(model):
        raise ApiError(
            403, f"Your tenant may not use the model `{model}`.", code="model_not_allowed"
        )
    return card


def served_model(gw: GatewayState, principal: Principal, model: str) -> str:
    """The model whose replicas serve `model`: an adapter's base model, else itself."""
    adapter = gw.adapters.visible(model, principal.tenant_id)
    return adapter.base_model if adapter else model


def adapter_ref(gw: GatewayState, principal: Principal, model: str) -> AdapterRef | None:
    """The adapter `model` names, as its requests carry it; None for a model."""
    adapter = gw.adapters.visible(model, principal.tenant_id)
    return adapter.ref if adapter else None


def tenant_of(principal: Principal) -> str:
    """The tenant a request is served for; a 403 for an admin key, which has none."""
    if principal.tenant_id is None:
        raise ApiError(403, "Admin keys belong to no tenant; use a tenant's key for inference.")
    return principal.tenant_id


_TASKS = {
    GENERATE: "generates text (/v1/chat/completions, /v1/completions)",
    EMBED: "is an embedding model (/v1/embeddings)",
}


def require_task(gw: GatewayState, principal: Principal, card: ModelCard, task: str) -> None:
    """A 400 for a model asked to do what it does not (a chat model asked for embeddings,
    an embedding model for a completion) that says what it does, and which models do
    what was asked."""
    if card.task == task:
        return
    others = [c.id for c in gw.router.cards.values() if c.task == task and principal.may_use(c.id)]
    raise ApiError(
        400,
        f"The model `{card.id}` {_TASKS[card.task]}; it cannot serve this request. "
        f"Models that can: {', '.join(others) or 'none'}.",
        code="wrong_model_task",
        param="model",
    )
