"""What a completion request reserves, decided from its rendered prompts alone.

Each choice may generate `max_tokens`; without it, as much as the context holds, but
never more than the tenant's tightest token limit could ever admit. A request that
could not be admitted even into an empty window is refused with a 400 that names the
limit: a 429 would tell the client to retry something that can never succeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.http.errors import ApiError
from gateway.tenancy.quota import QuotaLimits
from gateway.tenancy.quota.prices import to_usd, usd_text

_LIMIT_NAMES = {
    "tpm": "tokens per minute (tpm)",
    "daily_tokens": "tokens per day (daily_tokens)",
    "monthly_tokens": "tokens per month (monthly_tokens)",
    "rpm": "requests per minute (rpm)",
    "max_concurrent": "concurrent requests (max_concurrent)",
}


@dataclass(frozen=True)
class TokenPlan:
    choices: int  # prompts x n: each counts as a request and a concurrency slot
    max_tokens: list[int]  # per prompt
    reserve: int  # each prompt once (as usage counts it), plus every choice's max_tokens


def plan_tokens(
    prompts: list[list[int]],
    n: int,
    max_tokens: int | None,
    context_length: int,
    limits: QuotaLimits,
    param: str,
    min_tokens: int = 0,
) -> TokenPlan:
    """Raises ApiError(400) for an empty prompt, one past the context, or a request no
    window of the tenant's limits could ever admit."""
    choices = len(prompts) * n
    for field in ("rpm", "max_concurrent"):
        limit = getattr(limits, field)
        if limit is not None and choices > limit:
            _never(f"This request asks for {choices} choices", field, limit, "Lower n.")
    prompt_tokens = sum(len(p) for p in prompts)
    ceiling, tightest = _token_ceiling(limits)
    if ceiling is not None and prompt_tokens + choices > ceiling:
        _never(
            f"The prompt alone is {prompt_tokens} tokens", tightest, ceiling, "Shorten the prompt."
        )
    per_choice = None if ceiling is None else (ceiling - prompt_tokens) // choices
    plan = []
    for prompt in prompts:
        if not prompt:
            raise ApiError(400, "The prompt is empty.", param="prompt")
        room = context_length - len(prompt)
        wanted = max_tokens if max_tokens is not None else room
        if per_choice is not None and max_tokens is None:
            wanted = min(wanted, per_choice)  # reserve what can fit
        if wanted > room or room < 1:
            _context_exceeded(len(prompt), max_tokens, context_length, param)
        if min_tokens > wanted:
            raise ApiError(
                400,
                f"min_tokens ({min_tokens}) is more than the {wanted} tokens "
                "this request may generate (max_tokens, the context, the tenant's "
                "token limit).",
                param="min_tokens",
            )
        plan.append(wanted)
    reserve = prompt_tokens + n * sum(plan)
    if ceiling is not None and reserve > ceiling:
        _never(
            f"This request reserves {reserve} tokens ({prompt_tokens} in the prompt, "
            f"{n * sum(plan)} for max_tokens={max_tokens} x {choices} choices)",
            tightest,
            ceiling,
            "Lower max_tokens or n.",
        )
    return TokenPlan(choices, plan, reserve)


def check_input_tokens(tokens: list[int], context_length: int | None, limits: QuotaLimits) -> int:
    """The tokens an embedding request reserves (its inputs', counted once; no output):
    ApiError(400) for an input past the model's context (None: not checked here), or for
    a request no window of the tenant's limits could ever admit."""
    for i, n in enumerate(tokens):
        if context_length is not None and n > context_length:
            raise ApiError(
                400,
                f"This model's maximum context length is {context_length} tokens. However, "
                f"input {i} is {n} tokens. Please shorten it.",
                code="context_length_exceeded",
                param="input",
            )
    total = sum(tokens)
    ceiling, tightest = _token_ceiling(limits)
    if ceiling is not None and total > ceiling:
        _never(f"The input is {total} tokens", tightest, ceiling, "Send fewer or shorter inputs.")
    return total


REQUEST_COST = (
    "its prompt and max_tokens for every choice at the model's prices",
    "Lower max_tokens or n (without max_tokens, the context is reserved).",
)
PIN_COST = (
    "its tokens prefilled on every replica at the model's input price",
    "Shorten the prefix.",
)
EMBED_COST = (
    "its input tokens at the model's input price",
    "Send fewer or shorter inputs.",
)


def check_spend(worst: int, limits: QuotaLimits, cost: tuple[str, str] = REQUEST_COST) -> None:
    """Raises ApiError(400) when a request's worst-case cost (nanodollars) is more than a
    money budget holds whole: like a token limit, no window could ever admit it. `cost`:
    what the cost is made of, and what would make it fit."""
    for field, per in (("daily_spend", "day"), ("monthly_spend", "month")):
        limit = getattr(limits, field)
        if worst == 0 or limit is None or worst <= limit:
            continue
        key_limit = None if limits.key is None else getattr(limits.key, field)
        whose = "this API key's" if key_limit == limit else "your tenant's"
        raise ApiError(
            400,
            f"This request may cost up to ${usd_text(to_usd(worst))} ({cost[0]}), but "
            f"{whose} limit on spend per {per} ({field}) is ${usd_text(to_usd(limit))}: it "
            f"can never be admitted. {cost[1]}",
            code="exceeds_tenant_limit",
        )


def _token_ceiling(limits: QuotaLimits) -> tuple[int | None, str]:
    found = [(getattr(limits, f), f) for f in ("tpm", "daily_tokens", "monthly_tokens")]
    found = [(v, f) for v, f in found if v is not None]
    if not found:
        return None, ""
    return min(found)


def _never(what: str, field: str, limit: int, advice: str) -> None:
    raise ApiError(
        400,
        f"{what}, but your tenant's limit on {_LIMIT_NAMES[field]} is {limit}: it can "
        f"never be admitted. {advice}",
        code="exceeds_tenant_limit",
    )


def _context_exceeded(prompt_len: int, max_tokens: int | None, context: int, param: str) -> None:
    raise ApiError(
        400,
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the messages, "
        f"{max_tokens or 0} in the completion). "
        "Please reduce the length of the messages or completion.",
        code="context_length_exceeded",
        param=param,
    )
