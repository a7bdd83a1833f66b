"""Workload generators: lengths, seeds, shared prefixes, the bundled ShareGPT file."""

import json

import pytest

from bench.datasets import (
    DEFAULT_SHAREGPT,
    WORDS,
    load_sharegpt,
    random_requests,
    sample_lengths,
    shared_prefix_requests,
    sharegpt_requests,
)


def test_random_lengths_exact_without_range():
    reqs = random_requests(20, input_len=50, output_len=7, seed=1)
    assert len(reqs) == 20
    assert all(len(r.prompt.split()) == 50 == r.prompt_words for r in reqs)
    assert all(r.max_tokens == 7 for r in reqs)
    assert all(w in WORDS for r in reqs for w in r.prompt.split())


def test_random_lengths_with_range_ratio():
    reqs = random_requests(200, input_len=100, output_len=40, range_ratio=0.5, seed=3)
    ins = [len(r.prompt.split()) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150
    assert min(outs) >= 20 and max(outs) <= 60
    assert len(set(ins)) > 20  # lengths really vary


def test_random_is_seeded():
    a = random_requests(5, 30, 5, 0.3, seed=7)
    assert a == random_requests(5, 30, 5, 0.3, seed=7)
    assert a != random_requests(5, 30, 5, 0.3, seed=8)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 2.0])
def test_bad_range_ratio(ratio):
    with pytest.raises(ValueError, match="range-ratio"):
        sample_lengths(__import__("random").Random(0), 10, ratio, 3)


def test_shared_prefix():
    reqs = shared_prefix_requests(6, shared_prefix_len=40, input_len=10, output_len=5, seed=2)
    prefixes = {r.prompt.split("\n")[0] for r in reqs}
    suffixes = [r.prompt.split("\n")[1] for r in reqs]
    assert len(prefixes) == 1
    assert len(next(iter(prefixes)).split()) == 40
    assert all(len(s.split()) == 10 for s in suffixes)
    assert len(set(suffixes)) == 6
    assert all(r.prompt_words == 50 for r in reqs)


def test_several_prefixes_round_robin():
    reqs = shared_prefix_requests(6, 20, 5, 5, num_prefixes=2, seed=0)
    heads = [r.prompt.split("\n")[0] for r in reqs]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    with pytest.raises(ValueError):
        shared_prefix_requests(2, 0, 5, 5)


def test_random_prefix_order_gives_each_tenant_its_own_prefix():
    cycle = shared_prefix_requests(40, 20, 5, 5, num_prefixes=4, seed=3)
    reqs = shared_prefix_requests(40, 20, 5, 5, num_prefixes=4, seed=3, random_order=True)
    head_of = {i: cycle[i].prompt.split("\n")[0] for i in range(4)}  # the same prefixes
    assert all(r.prompt.split("\n")[0] == head_of[r.tenant] for r in reqs)
    order = [r.tenant for r in reqs]
    assert set(order) == {0, 1, 2, 3} and order != [i % 4 for i in range(40)]
    assert all(r.tenant is None for r in cycle)


def test_bundled_sharegpt_file():
    pairs = load_sharegpt(DEFAULT_SHAREGPT)
    assert len(pairs) >= 30
    assert all(q.strip() and a.strip() for q, a in pairs)
    reqs = sharegpt_requests(50, seed=0)
    assert len(reqs) == 50  # wraps around the file
    assert {r.prompt for r in reqs} <= {q for q, _ in pairs}
    assert all(r.max_tokens >= 4 for r in reqs)
    assert all(r.max_tokens == 12 for r in sharegpt_requests(5, output_len=12))


def test_sharegpt_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="JSON list"):
        load_sharegpt(bad)
    bad.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "hi"}]}]))
    with pytest.raises(ValueError, match="no conversation"):
        load_sharegpt(bad)
