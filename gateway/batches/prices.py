"""The batch price of a model: its [batch_prices."model"] where the config has one, else
half its price (what hosted providers charge for batch work), each rate rounded up to
the picodollar a token."""

from __future__ import annotations

from gateway.state import GatewayState
from gateway.tenancy.quota.prices import Price


def batch_price(gw: GatewayState, model: str) -> Price:
    own = gw.settings.batch_prices.get(model)
    if own is not None:
        return own
    p = gw.price_of(model)
    return Price(_half(p.input), _half(p.cached_input), _half(p.output))


def _half(picos: int) -> int:
    return (picos + 1) // 2
