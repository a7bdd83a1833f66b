"""What a request costs: per-model prices and exact integer money.

Prices are USD per million tokens (as providers list them) with at most six decimals, so
each one is a whole number of picodollars per token, and a request's cost is a sum of
integer products. Spend is kept in nanodollars (10^-9 USD), rounded up once per request:
usage rows, daily totals and the quota counters all add the same integers, so no sum of
floats drifts, and a 64-bit column holds 9.2 billion dollars. A price is at most
MAX_USD_PER_MILLION, a dollar a token, so that no request's spend (nor its worst case)
comes near what a usage row holds. A model with no price costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

NANOS_PER_USD = 10**9
_PICOS_PER_NANO = 1000
_PICOS_PER_USD_PER_MILLION = 10**6  # USD per 10^6 tokens, as picodollars per token
PRICE_FIELDS = ("input", "cached_input", "output")
MAX_USD_PER_MILLION = 10**6


def to_nanos(usd: float | int | str | Decimal) -> int:
    """Dollars as nanodollars, exactly as written (0.1 is 100000000, not a float's
    nearest), rounded half up below the nanodollar."""
    return int((_decimal(usd, "an amount") * NANOS_PER_USD).to_integral_value("ROUND_HALF_UP"))


def to_usd(nanos: int) -> float:
    return nanos / NANOS_PER_USD


def usd_text(usd: float) -> str:
    """Dollars to the nanodollar at most, to the cent at least: 0.00, 1.50, 0.0000125."""
    text = f"{usd:.9f}".rstrip("0")
    return text + "0" * (2 - len(text.split(".")[1]))


@dataclass(frozen=True)
class Price:
    """One model's prices, in picodollars per token (USD per million tokens x 10^6)."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    @classmethod
    def from_usd_per_million(cls, model: str, table: Mapping[str, Any]) -> Price:
        """`input`, `cached_input` (default: `input`) and `output`, USD per million tokens."""
        unknown = sorted(set(table) - set(PRICE_FIELDS))
        if unknown:
            raise ValueError(f"prices.{model}: unknown fields {unknown}; use {list(PRICE_FIELDS)}")
        picos = {f: _picos(model, f, table[f]) for f in PRICE_FIELDS if f in table}
        picos.setdefault("cached_input", picos.get("input", 0))
        return cls(**picos)

    def spend(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Nanodollars: prompt tokens less the cached ones at the input price, the cached
        ones at the cached price, completion tokens at the output price."""
        cached = min(cached_tokens, prompt_tokens)
        picos = (
            (prompt_tokens - cached) * self.input
            + cached * self.cached_input
            + completion_tokens * self.output
        )
        return _nanos_up(picos)

    def input_cost(self, tokens: int) -> int:
        """Nanodollars for prefilling `tokens` uncached (a pin's prefill)."""
        return self.spend(tokens, 0, 0)

    def worst_case(self, prompt_tokens: int, completion_tokens: int) -> int:
        """The most `spend` can come to with at most these tokens: what admission reserves."""
        dearest_prompt = max(self.input, self.cached_input)
        return _nanos_up(prompt_tokens * dearest_prompt + completion_tokens * self.output)

    def usd_per_million(self) -> dict[str, float]:
        return {f: getattr(self, f) / _PICOS_PER_USD_PER_MILLION for f in PRICE_FIELDS}


FREE = Price()


def parse_prices(tables: Mapping[str, Any]) -> dict[str, Price]:
    """The config's `[prices."model"]` tables (or Price values) by served model name."""
    prices = {}
    for model, table in tables.items():
        if isinstance(table, Price):
            prices[model] = table
        elif isinstance(table, Mapping):
            prices[model] = Price.from_usd_per_million(model, table)
        else:
            raise ValueError(f"prices.{model} must be a table of input, cached_input, output")
    return prices


def _nanos_up(picos: int) -> int:
    # up, so that a request's spend never exceeds its worst case (rounding is monotonic)
    return -(-picos // _PICOS_PER_NANO)


def _picos(model: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError(f"prices.{model}.{name} must be a number (USD per million tokens)")
    picos = _decimal(value, f"prices.{model}.{name}") * _PICOS_PER_USD_PER_MILLION
    if picos < 0 or picos != picos.to_integral_value():
        raise ValueError(
            f"prices.{model}.{name} must be >= 0 USD per million tokens with at most six "
            f"decimals, got {value!r}"
        )
    if picos > MAX_USD_PER_MILLION * _PICOS_PER_USD_PER_MILLION:
        raise ValueError(
            f"prices.{model}.{name} must be at most {MAX_USD_PER_MILLION} USD per million "
            f"tokens (a dollar a token), got {value!r}"
        )
    return int(picos)


def _decimal(value: Any, what: str) -> Decimal:
    # a float by its shortest repr: 0.075 is 0.075, not the binary fraction nearest it
    try:
        number = Decimal(repr(value) if isinstance(value, float) else str(value))
    except InvalidOperation:
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not number.is_finite():
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return number
