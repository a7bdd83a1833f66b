"""An admitted request's replica: picked by the router among the healthy candidates, by the
first prompt's block hashes (salted per tenant, as the engines key them), and claimed.

Apart from admission because it is the routing step (the `kvgate.route` span) with its own
inputs: the published prefixes' lengths (gateway.routing.pins), the block hashes a prefix-
caching replica computes, the router's pick and claim; and because it runs after the quota
is taken, it gives that quota back if it fails.
"""

from __future__ import annotations

from engine_api.images import ImageInput
from engine_api.records import AdapterRef
from gateway.backends import Backend, PrefixCachingBackend
from gateway.backends.capabilities import supports
from gateway.observe.tracing import REPLICA, step
from gateway.routing.router import Candidate
from gateway.state import GatewayState
from gateway.tenancy.quota import Reservation


async def place(
    gw: GatewayState,
    model: str,
    candidates: list[Candidate],
    renderer: Backend,
    prompts: list[list[int]],
    salt: str,
    reservation: Reservation,
    adapter: AdapterRef | None = None,
    images: list[ImageInput] | None = None,
) -> tuple[Backend, list[str], list[int]]:
    """The replica to serve it, claimed until the Job finishes, with the first prompt's
    block hashes it was picked by (a chat's images keying their placeholders' blocks, as
    the engine keys them) and each prompt's published prefix length. If picking fails,
    the admitted quota is given back."""
    try:
        with step(gw.tracing, "kvgate.route") as span:
            # a published prefix's length per prompt: its blocks are hashed without the salt
            shared_lens = [gw.pins.shared_prefix_len(model, p) for p in prompts]
            block_hashes = []
            if supports(renderer, PrefixCachingBackend):
                # only a vision model's replica (it took the images) is handed them
                by_image = {"images": images} if images else {}
                block_hashes = renderer.block_hashes(
                    prompts[0], salt, shared_lens[0], adapter, **by_image
                )
            name = adapter.name if adapter else None
            backend, why = gw.router.pick_why(candidates, block_hashes, name)
            gw.router.claim(backend)  # released when the Job finishes
            if span is not None:
                span.set_attributes(
                    {
                        REPLICA: backend.name,
                        "kvgate.route.reason": why,
                        "kvgate.route.policy": gw.router.policy,
                        "kvgate.route.candidates": len(candidates),
                        "kvgate.route.prompt_blocks": len(block_hashes),
                    }
                )
    except BaseException:
        await gw.quota.settle(reservation, 0, count_request=False)
        raise
    return backend, block_hashes, shared_lens
