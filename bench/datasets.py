"""Benchmark workloads: random, shared-prefix and ShareGPT-format prompts.

The server tokenizes, not us, so random prompts are built from common English
words that most tokenizers keep as one token each; the prompt length a result
reports is always the server's own `usage.prompt_tokens`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
DEFAULT_SHAREGPT = DATA_DIR / "kvgate_sharegpt.json"

_WORD_TEXT = """
the of and to in is was for on that with as by at from his it an were are which be
this had not but first one their its new after who they have her she two been other
when there all during into school time may years more most only over city some world
would where later up such used many can state about national out known university
united then made team year these three film people under well since game both part
so music high him season album we also series before through work between while each
number river party north south east west center great house like what any day life
long name place water war line light home land power road back small large old young
black white red green blue open free full hand head side book room story table
market money field group order point report area family level office paper price
rule sea ship sound star stone street town tree wind word
"""
# Short, frequent words: one token each in the Gemma, Llama and GPT-2 vocabularies.
WORDS = tuple(_WORD_TEXT.split())


@dataclass
class SampleRequest:
    """One prompt to send. `prompt_words` is our own size target, not a token count.
    `tenant`: the tenant (index) that sends it; None: tenants take turns."""

    prompt: str
    max_tokens: int
    prompt_words: int
    tenant: int | None = None


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """n lengths drawn uniformly from [mean*(1-r), mean*(1+r)] (vLLM's random dataset)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[SampleRequest]:
    """Independent prompts of about `input_len` tokens; each asks for its own output length."""
    rng = random.Random(seed)
    input_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    return [
        SampleRequest(random_words(rng, n_in), n_out, n_in)
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def shared_prefix_requests(
    num_prompts: int,
    shared_prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    num_prefixes: int = 1,
    seed: int = 0,
    random_order: bool = False,
) -> list[SampleRequest]:
    """Prompts that start with one of `num_prefixes` long common prefixes (a system prompt)
    followed by a unique suffix of about `input_len` tokens: the prefix-cache workload.
    The prefixes take turns; with `random_order` each prompt draws one at random and is
    sent by the tenant of that index (one system prompt per tenant, tenants in no order)."""
    if shared_prefix_len < 1 or num_prefixes < 1:
        raise ValueError("--shared-prefix-len and --num-prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [random_words(rng, shared_prefix_len) for _ in range(num_prefixes)]
    suffix_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for i, (n_in, n_out) in enumerate(zip(suffix_lens, output_lens, strict=True)):
        index = rng.randrange(num_prefixes) if random_order else i % num_prefixes
        prompt = prefixes[index] + "\n" + random_words(rng, n_in)
        tenant = index if random_order else None
        requests.append(SampleRequest(prompt, n_out, shared_prefix_len + n_in, tenant))
    return requests


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first gpt reply) pairs from a ShareGPT-format JSON file."""
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for entry in entries:
        turns = entry.get("conversations", []) if isinstance(entry, dict) else []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path}: no conversation starts with a human turn and a gpt reply")
    return pairs


def sharegpt_requests(
    num_prompts: int,
    path: str | Path = DEFAULT_SHAREGPT,
    output_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Real questions; max_tokens is `output_len` when given, else the length of the
    recorded reply, estimated from its words (a request parameter, never a reported count)."""
    pairs = load_sharegpt(path)
    rng = random.Random(seed)
    rng.shuffle(pairs)
    requests = []
    for i in range(num_prompts):
        question, reply = pairs[i % len(pairs)]
        max_tokens = output_len or max(4, round(len(reply.split()) * 4 / 3))
        requests.append(SampleRequest(question, max_tokens, len(question.split())))
    return requests
