"""Writes load.jsonl: two minutes of a busy gateway, one snapshot a second, seeded.

The numbers follow the shape of a real run (a ramp, then steady load with noise,
one tenant hitting its rate limit, one near its money budget, a backend that goes
down for a while), so the dashboard tests and the README screenshot read like a
real gateway.
Run: .venv/bin/python tests/tui/data/make_replay.py
"""

import json
import math
import random
from pathlib import Path

START = 1764441600.0  # 2025-11-29 18:40:00 UTC
STARTED_AT = START - 3725.0
SECONDS = 120

# id, name, share of traffic, rpm limit, daily token budget, monthly budget
TENANTS = [
    ("t_ac01", "acme", 0.38, 600, 5_000_000, None),
    ("t_gl02", "globex", 0.22, None, None, 60_000_000),
    ("t_in03", "initech", 0.16, 120, 2_000_000, None),
    ("t_um04", "umbrella", 0.12, 300, None, None),
    ("t_hk05", "hooli", 0.08, 60, 400_000, 4_000_000),
    ("t_st06", "stark", 0.04, None, None, None),
]
USD_PER_TOKEN = 2e-6  # one price for every token, so spend follows the token counters
# money budgets in USD, daily and monthly; the other tenants have none
SPEND_BUDGETS = {"t_gl02": (2.5, None), "t_hk05": (None, 10.0)}


def usd(tokens: int) -> float:
    # to the nanodollar, as the gateway reports it
    return round(tokens * USD_PER_TOKEN, 9)


def snapshot(i: int, rng: random.Random, totals: dict, tenant_totals: dict, errors: list) -> dict:
    ts = START + i
    ramp = min(1.0, (i + 1) / 30)
    wave = 1.0 + 0.15 * math.sin(i / 9)
    rps = round(24.0 * ramp * wave * rng.uniform(0.92, 1.08), 2)
    out_tps = round(rps * 71 * rng.uniform(0.95, 1.05), 1)
    prompt_tps = round(rps * 43 * rng.uniform(0.9, 1.1), 1)
    local_down = 70 <= i < 82
    totals["requests"] += int(rps)
    totals["prompt_tokens"] += int(prompt_tps)
    totals["completion_tokens"] += int(out_tps)
    if i % 17 == 5:
        errors.append(
            {
                "ts": ts - 0.4,
                "tenant": "hooli",
                "model": "gemma-3-270m",
                "status": 429,
                "message": "rate limit: 60 requests per minute",
            }
        )
        totals["rejected_429"] += 1
    if local_down and i % 4 == 0:
        errors.append(
            {
                "ts": ts - 0.2,
                "tenant": "globex",
                "model": "gemma-3-270m-local",
                "status": 503,
                "message": "backend local-0 is down",
            }
        )
        totals["errors"] += 1
    del errors[:-20]
    in_flight = max(0, int(rps * 0.9 + rng.uniform(-2, 2)))
    totals["in_flight"] = in_flight
    tenants = []
    for tid, name, share, rpm, daily, monthly in TENANTS:
        t_rps = round(rps * share * rng.uniform(0.8, 1.2), 2)
        t_tps = round((out_tps + prompt_tps) * share * rng.uniform(0.8, 1.2), 1)
        tt = tenant_totals[tid]
        tt["requests"] += int(t_rps)
        tt["tokens"] += int(t_tps)
        if name == "hooli" and i % 17 == 5:
            tt["rejected_429"] += 1
        rpm_used = min(rpm or 10**9, int(t_rps * 60))
        tenants.append(
            {
                "id": tid,
                "name": name,
                "requests": tt["requests"],
                "tokens": tt["tokens"],
                "requests_per_s": t_rps,
                "tokens_per_s": t_tps,
                "rejected_429": tt["rejected_429"],
                "in_flight": max(0, round(in_flight * share)),
                "quota": {
                    "rpm": rpm,
                    "rpm_used": rpm_used,
                    "tpm": None,
                    "tpm_used": int(t_tps * 60),
                    "daily_tokens": daily,
                    "daily_used": tt["base_daily"] + tt["tokens"],
                    "monthly_tokens": monthly,
                    "monthly_used": tt["base_monthly"] + tt["tokens"],
                    "daily_spend": SPEND_BUDGETS.get(tid, (None, None))[0],
                    "daily_spend_used": usd(tt["base_daily"] + tt["tokens"]),
                    "monthly_spend": SPEND_BUDGETS.get(tid, (None, None))[1],
                    "monthly_spend_used": usd(tt["base_monthly"] + tt["tokens"]),
                },
            }
        )
    gpu_running = max(1, round(in_flight * (1.0 if local_down else 0.8)))
    local_running = 0 if local_down else max(0, in_flight - gpu_running)
    totals["prefix_queries"] += int(rps)
    totals["prefix_hits"] += int(rps * 0.62)
    totals["preemptions"] += 1 if rps > 26 else 0
    return {
        "ts": ts,
        "gateway": {
            "url": "http://127.0.0.1:8000",
            "version": "0.1.0",
            "started_at": STARTED_AT,
            "uptime_s": ts - STARTED_AT,
        },
        "totals": {
            k: totals[k]
            for k in (
                "requests",
                "errors",
                "rejected_429",
                "prompt_tokens",
                "completion_tokens",
                "in_flight",
            )
        },
        "rates": {
            "requests_per_s": rps,
            "prompt_tokens_per_s": prompt_tps,
            "output_tokens_per_s": out_tps,
        },
        "latency": {
            "ttft_p50_ms": round(28 + 12 * ramp * wave, 1),
            "ttft_p99_ms": round(95 + 60 * ramp * wave, 1),
            "tpot_p50_ms": round(8.5 + 2 * ramp, 1),
            "tpot_p99_ms": round(17 + 6 * ramp * wave, 1),
            "e2e_p50_ms": round(640 + 200 * ramp, 1),
            "e2e_p99_ms": round(1900 + 600 * ramp * wave, 1),
        },
        "backends": [
            {
                "name": "gpu-0",
                "type": "gpu",
                "healthy": True,
                "models": ["gemma-3-270m"],
                "running": gpu_running,
                "waiting": max(0, round(rps / 6 - 1)),
                "kv_usage": round(min(0.97, 0.2 + 0.55 * ramp * wave), 3),
                "prefix_queries": totals["prefix_queries"],
                "prefix_hits": totals["prefix_hits"],
                "preemptions": totals["preemptions"],
                "prompt_tokens_per_s": round(prompt_tps * 0.8, 1),
                "gen_tokens_per_s": round(out_tps * (1.0 if local_down else 0.8), 1),
            },
            {
                "name": "local-0",
                "type": "local",
                "healthy": not local_down,
                "models": ["gemma-3-270m-local"],
                "running": local_running,
                "waiting": 0,
                "kv_usage": 0.0 if local_down else round(0.3 * ramp, 3),
                "prefix_queries": 0,
                "prefix_hits": 0,
                "preemptions": 0,
                "prompt_tokens_per_s": 0.0 if local_down else round(prompt_tps * 0.2, 1),
                "gen_tokens_per_s": 0.0 if local_down else round(out_tps * 0.2, 1),
            },
        ],
        "tenants": tenants,
        "errors": list(errors),
    }


def main() -> None:
    rng = random.Random(7)
    totals = dict.fromkeys(
        [
            "requests",
            "errors",
            "rejected_429",
            "prompt_tokens",
            "completion_tokens",
            "in_flight",
            "prefix_queries",
            "prefix_hits",
            "preemptions",
        ],
        0,
    )
    tenant_totals = {
        tid: {
            "requests": 0,
            "tokens": 0,
            "rejected_429": 0,
            "base_daily": int(4_000_000 * share),
            "base_monthly": int(30_000_000 * share),
        }
        for tid, _, share, *_ in TENANTS
    }
    errors: list = []
    lines = [json.dumps(snapshot(i, rng, totals, tenant_totals, errors)) for i in range(SECONDS)]
    out = Path(__file__).with_name("load.jsonl")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} snapshots to {out}")


if __name__ == "__main__":
    main()
