"""EAGLE-3 heads: loaded as published, refused by name when they do not fit, and
proposing in the engine with the target's own hidden states.

A random head's guesses are seldom right, but greedy output must equal plain greedy
token for token, sampled output must keep the target's distribution, and every block
(the target's and the head's own pool) must come back.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from backend_gpu import LLM, SamplingParams
from backend_gpu.config import EngineConfig
from engine_api.records import AdapterRef
from tests.backend_gpu.eagle3_heads import edit_config, edit_tensors, write_random_head
from tests.backend_gpu.test_spec_decode import (
    GREEDY,
    _sampled_tokens,
    _tv,
    assert_all_blocks_back,
    copy_prompts,
)


def eagle3(head: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def llama_head(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    target = tiny_model_dir("llama")
    return target, write_random_head(target, str(tmp_path_factory.mktemp("head") / "h"))


def assert_head_blocks_back(llm: LLM) -> None:
    assert_all_blocks_back(llm)
    proposer = llm.engine.speculator.proposer
    assert not proposer.states
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


# --- configuration and loading ---------------------------------------------------------


@pytest.mark.parametrize("k", [0, 17])
def test_speculative_tokens_outside_1_to_16_are_refused(k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(model="unused", speculative_config=eagle3("x", k))


def test_eagle3_needs_a_head():
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="EAGLE-3 head directory"):
        EngineConfig(model="unused", speculative_config=spec)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"draft_confidence_threshold": 1.0}, r"in \[0, 1\), got 1.0"),
        ({"draft_confidence_threshold": "high"}, "must be a number"),
        ({"method": "ngram", "model": None, "draft_confidence_threshold": 0.5}, "'eagle3' method"),
    ],
)
def test_bad_confidence_thresholds_are_refused(change, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(model="unused", speculative_config=eagle3("x") | change)


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _narrow(name):
    return lambda t: t | {name: t[name][:, :-1].contiguous()}


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (_drop("midlayer.mlp.up_proj.weight"), r"lacks \['midlayer.mlp.up_proj.weight'\]"),
        (_drop("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight"),
        (_narrow("fc.weight"), r"model.fc.weight: checkpoint shape \(64, 191\)"),
        (_narrow("midlayer.self_attn.k_proj.weight"), "self_attn.k_proj.weight: checkpoint shape"),
        (lambda t: t | {"extra.weight": torch.zeros(2)}, "unexpected checkpoint tensor extra"),
    ],
)
def test_missing_or_misshapen_tensors_are_named(llama_head, tmp_path, change, error):
    target, head = llama_head
    bad = shutil.copytree(head, tmp_path / "bad")
    edit_tensors(bad, change)
    with pytest.raises(ValueError, match=error):
        LLM(target, speculative_config=eagle3(str(bad)))


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"hidden_size": 32}, "hidden_size 32 differs from the target's 64"),
        ({"vocab_size": 500}, "vocab_size 500 differs .* another tokenizer"),
        ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLMEagle3"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}, "three layers of the target's 0..1"),
        ({"eagle_aux_hidden_state_layer_ids": None}, r"\[2, 1, -1\]"),  # the default: L = 2
    ],
)
def test_heads_that_do_not_fit_the_target_are_refused(llama_head, tmp_path, config, error):
    target, head = llama_head
    bad = shutil.copytree(head, tmp_path / "bad")
    edit_config(bad, **config)
    with pytest.raises(ValueError, match=error):
        LLM(target, speculative_config=eagle3(str(bad)))


def test_published_variants_load_alike(llama_head, tmp_path):
    """A `model.` prefix, the head's own embed_tokens, no d2t/t2d over the whole
    vocabulary, the layer ids nested under eagle_config: the same head."""
    target, head = llama_head
    variant = shutil.copytree(head, tmp_path / "variant")
    own_embed = torch.randn(384, 64)
    edit_tensors(
        variant,
        lambda t: (
            {f"model.{k}": v for k, v in t.items() if k not in ("d2t", "t2d")}
            | {"model.embed_tokens.weight": own_embed}
        ),
    )
    edit_config(
        variant,
        eagle_aux_hidden_state_layer_ids=None,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]},
    )
    first = LLM(target, speculative_config=eagle3(head)).engine.speculator.proposer.head
    second = LLM(target, speculative_config=eagle3(str(variant))).engine.speculator.proposer.head
    stored = load_file(f"{head}/model.safetensors")
    torch.testing.assert_close(first.model.fc.weight, stored["fc.weight"])
    qkv = first.model.layers[0].self_attn.qkv_proj.weight
    torch.testing.assert_close(qkv[:64], stored["midlayer.self_attn.q_proj.weight"])
    target_embed = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]
    torch.testing.assert_close(first.model.embed_tokens.weight, target_embed)
    torch.testing.assert_close(second.model.embed_tokens.weight, own_embed)
    for name, param in first.named_parameters():
        if "embed_tokens" not in name:
            torch.testing.assert_close(param, dict(second.named_parameters())[name])


def test_a_draft_vocabulary_maps_through_d2t(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    draft_ids = [3, 17, 40, 41, 200, 383]
    head_dir = write_random_head(target, str(tmp_path / "h"), draft_ids, nested=True)
    head = LLM(target, speculative_config=eagle3(head_dir)).engine.speculator.proposer.head
    assert head.lm_head.weight.shape == (6, 64)
    logits = head.compute_logits(torch.randn(5, 64))
    finite = torch.isfinite(logits).nonzero()[:, 1].unique().tolist()
    assert finite == draft_ids
    assert (logits.argmax(-1)[:, None] == torch.tensor(draft_ids)).any(-1).all()


# --- the engine ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_output_equals_plain_greedy(tiny_model_dir, tmp_path, arch):
    """Batched, with chunked prefill (a 24-token budget cuts the prompts) and the
    prefix cache (every prompt twice: the second reads the first's blocks)."""
    target = tiny_model_dir(arch)
    head = write_random_head(target, str(tmp_path / "h"), aux_layers=(1, 0, 1))
    opts = {"max_num_batched_tokens": 24, "enable_prefix_caching": True}
    plain = LLM(target, **opts)
    spec = LLM(target, **opts, speculative_config=eagle3(head, k=4))
    prompts = copy_prompts(plain.tokenizer) * 2
    want = plain.generate(prompts, GREEDY)
    got = spec.generate(prompts, GREEDY)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.text == b.text and a.finish_reason == b.finish_reason
    stats = spec.stats()
    assert stats.num_draft_tokens > 0 and stats.num_drafts > 0
    assert stats.prefix_hits > 0
    assert_head_blocks_back(spec)


def test_a_chain_stops_at_the_heads_doubt(llama_head):
    """A random head is never sure of a guess (its probabilities spread over the whole
    vocabulary): under a confidence threshold each chain is its first guess alone,
    without one k guesses; greedy output is plain's either way, sampled requests run."""
    target, head = llama_head
    plain = LLM(target)
    prompts = copy_prompts(plain.tokenizer)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    for threshold in (None, 0.5):
        config = eagle3(head) | {"draft_confidence_threshold": threshold}
        spec = LLM(target, speculative_config=config)
        assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want
        stats = spec.stats()
        assert stats.num_drafts > 0
        if threshold is None:  # k = 3, less near max_tokens
            assert stats.num_draft_tokens > 2.5 * stats.num_drafts
        else:
            assert stats.num_draft_tokens == stats.num_drafts
        sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
        assert all(len(o.token_ids) == 12 for o in spec.generate(prompts, sampled))
        assert_head_blocks_back(spec)


def test_the_head_reads_the_targets_hidden_states(llama_head):
    """The rows the head catches up on are the target's layer inputs: a prefill of the
    prompt computes them once, and the head's first pass reads them."""
    target, head = llama_head
    spec = LLM(target, speculative_config=eagle3(head))
    engine = spec.engine
    captured = {}
    layer = engine.runner.model.model.layers[1]

    def keep(module, args) -> None:
        captured.setdefault("x", args[1].clone())

    layer.register_forward_pre_hook(keep)
    from tests.requests import req

    prompt = copy_prompts(spec.tokenizer)[0]
    engine.add_request(req("r", prompt, GREEDY))
    engine.step()  # the prefill: the head's rows kept, none read yet
    state = engine.speculator.proposer.states["r"]
    (start, rows), *more = state.pending
    assert start == 0 and not more and rows.shape == (len(prompt), 3 * 64)
    torch.testing.assert_close(rows[:, 64:128], captured["x"])  # layer 1, second of (0, 1, 1)
    torch.testing.assert_close(rows[:, 128:], captured["x"])
    engine.step()  # a proposal reads them; the verifying step keeps its own 1 + k rows
    assert state.verified == len(prompt)
    ((start, rows),) = state.pending
    assert start == len(prompt) and rows.shape[0] == 1 + 3


def test_the_engines_chain_computes_what_the_trainer_trains(llama_head):
    """The engine's paged head and the trainer's forward (studies/eagle3_ttt.py) agree:
    a chain proposed after the prefill, and one after a few verifying steps (the head
    caught up on verified rows), give the logits the training-time test gives at the
    chain's anchor, step by step, fed the same tokens and the target's hidden states."""
    from studies.eagle3_ttt import Eagle3TTT
    from studies.train_eagle3 import features
    from tests.requests import req

    target, head_dir = llama_head
    spec = LLM(target, speculative_config=eagle3(head_dir))
    engine = spec.engine
    proposer = engine.speculator.proposer
    chains = []
    propose = proposer.propose

    def spy(seqs, ks, sampler):
        logits = []
        head = proposer.head
        greedy = head.greedy_tokens

        def keep(prenorm):  # the head's whole vocabulary is the draft one here
            logits.append(head.lm_head(head.model.norm(prenorm))[-1])
            return greedy(prenorm)

        head.greedy_tokens = keep
        try:
            drafts, q = propose(seqs, ks, sampler)
        finally:
            del head.greedy_tokens
        chains.append((list(seqs[0].token_ids), drafts[0], logits))
        return drafts, q

    proposer.propose = spy
    engine.add_request(req("r", copy_prompts(spec.tokenizer)[1], GREEDY))
    for _ in range(6):
        engine.step()
    with open(f"{head_dir}/config.json") as f:
        cfg = json.load(f)
    for tokens, draft, logits in (chains[0], chains[-1]):
        assert len(draft) == 3
        ids = tokens + draft[:-1]  # the chain's inputs: its own guesses after the last token
        (aux,), _, embed, *_ = features(target, [ids], cfg["eagle_aux_hidden_state_layer_ids"])
        ttt = Eagle3TTT(cfg, embed)
        stored = load_file(f"{head_dir}/model.safetensors")
        ttt.load_state_dict({k: v for k, v in stored.items() if k not in ("d2t", "t2d")})
        with torch.no_grad():
            want = ttt(torch.tensor([ids]), aux[None], 3)
        anchor = len(tokens) - 2  # the head's position t reads token t + 1
        for j in range(3):
            torch.testing.assert_close(logits[j], want[j][0, anchor], atol=1e-4, rtol=1e-4)
            assert int(logits[j].argmax()) == draft[j]


def test_bf16_features_are_float32_and_near_the_float32_ones(llama_head):
    """--bf16's features: the target under bfloat16 autocast, its states kept as float32,
    within bfloat16's rounding of the float32 pass's."""
    from studies.train_eagle3 import features

    target, head_dir = llama_head
    with open(f"{head_dir}/config.json") as f:
        layers = json.load(f)["eagle_aux_hidden_state_layer_ids"]
    ids = [list(range(3, 40)), list(range(50, 70))]
    exact, low = features(target, ids, layers), features(target, ids, layers, bf16=True)
    for a, b in ((exact.aux, low.aux), (exact.final, low.final)):
        for x, y in zip(a, b, strict=True):
            assert y.dtype == torch.float32 and y.shape == x.shape
            assert not torch.equal(x, y)  # it did run in bfloat16
            assert (x - y).norm() <= 0.05 * x.norm()


def test_sampled_output_keeps_the_targets_distribution(tiny_model_dir, tmp_path):
    """600 seeds, three tokens each: a random head over the few tokens the target
    samples here (so that some guesses stand) leaves the target's distribution. A
    random head couples the two runs less than a draft like the target does: plain
    against plain under other seeds measured 0.055 to 0.065 at 400 seeds, so the bound
    is wider than test_spec_decode's; a head's own choices would be 0.3 away."""
    target = tiny_model_dir("llama")
    n = 600
    want = _sampled_tokens(LLM(target), n)
    seen = sorted({tok for t in want for tok in t})
    head = write_random_head(target, str(tmp_path / "h"), seen, seed=3)
    spec = LLM(target, speculative_config=eagle3(head, k=2))
    got = _sampled_tokens(spec, n)
    stats = spec.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for pick in (lambda t: t[1], lambda t: t[2], lambda t: t):
        assert _tv([pick(t) for t in got], [pick(t) for t in want]) < 0.09
    assert_head_blocks_back(spec)


def test_preemption_and_abort_give_every_block_back(llama_head):
    target, head = llama_head
    from tests.requests import req

    pool = {"kv_cache_memory_bytes": 100_000, "max_model_len": 192}
    spec = LLM(target, **pool, speculative_config=eagle3(head))
    plain = LLM(target, **pool)
    engine = spec.engine
    prompts = copy_prompts(spec.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(req(str(i), prompt, params))
    for _ in range(6):
        engine.step()
    engine.abort_request("3")
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert spec.stats().preemptions > 0
    want = plain.generate(prompts[:3], params)
    assert [outs[str(i)].token_ids for i in range(3)] == [o.token_ids for o in want]
    assert_head_blocks_back(spec)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
def test_a_head_the_trainer_writes_loads_and_keeps_greedy_output(tiny_model_dir, tmp_path, bf16):
    """studies/train_eagle3 for three steps on the tiny Llama: the target answers the
    docs' prompts (kept in --answers), the head trains and is written as published;
    the engine loads it. Under --bf16 too: the passes in bfloat16, the head float32."""
    from studies import train_eagle3

    target = tiny_model_dir("llama")
    head = str(tmp_path / "head")
    args = ["--model", target, "--out", head, "--prompts", "6", "--max-tokens", "8"]
    args += ["--max-steps", "3", "--batch", "2", "--eval-every", "1", "--held-out", "2"]
    args += ["--schedule", "cosine"]  # the rate down to 0 at step 3
    args += ["--bf16"] * bf16
    answers = tmp_path / "answers.json"
    result = train_eagle3.main([*args, "--draft-vocab", "100", "--answers", str(answers)])
    assert [p["step"] for p in result["curve"]] == [1, 2, 3]
    # the last step, at a rate of 0, leaves the head as it was
    assert result["curve"][1]["accuracy"] == result["curve"][2]["accuracy"]
    assert len(json.loads(answers.read_text())) == result["sequences"]
    assert all(p["loss"] > 0 and 1 <= p["acceptance_length"] <= 4 for p in result["curve"])
    stored = load_file(f"{head}/model.safetensors")
    assert stored["lm_head.weight"].shape == (result["draft_vocab_size"], 64)
    assert stored["fc.weight"].dtype == torch.float32 and result["bf16"] == bf16
    assert (
        stored["d2t"].shape == (result["draft_vocab_size"],) and "embed_tokens.weight" not in stored
    )
    plain = LLM(target)
    spec = LLM(target, speculative_config=eagle3(head))
    prompts = copy_prompts(plain.tokenizer)
    want = plain.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == [o.token_ids for o in want]
    assert spec.stats().num_draft_tokens > 0
    assert_head_blocks_back(spec)


def test_the_offline_score_applies_the_engines_stopping_rule(llama_head):
    """studies/eagle3_score on the tiny Llama: a random head is never sure, so under a
    threshold every chain is its first guess (2 rows a verify), without one k guesses
    (4 rows); what it accepts is at most what it proposes."""
    from studies import eagle3_score

    target, head = llama_head
    args = ["--model", target, "--head", head, "--sets", "chat", "--max-tokens", "8"]
    result = eagle3_score.main([*args, "--k", "3", "--confidence", "0.5"])
    rows = result["sets"]["chat"]
    assert rows["0"]["verify_rows"] == 4.0 and rows["0.5"]["verify_rows"] == 2.0
    for r in rows.values():
        assert 1 <= r["acceptance_length"] <= r["verify_rows"]
    assert rows["0.5"]["accuracy"] == rows["0"]["accuracy"]
    assert result["in_draft_vocabulary"] == {"chat": 1.0}  # the head's is the whole one


def test_the_gpu_steps_study_runs_on_a_tiny_shape(tmp_path):
    """studies/eagle3_gpu (a gpu_check.sh step) on the CPU: a random head of the
    target's shape written and loaded, both engines' step times per batch."""
    from studies import eagle3_gpu

    args = ["--out", str(tmp_path), "--shape", "tiny", "--device", "cpu", "--dtype", "float32"]
    result = eagle3_gpu.main([*args, "--batches", "1", "2", "--steps", "2", "--prompt", "8"])
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    assert all(row["eagle3_step_ms"] > 0 and row["plain_step_ms"] > 0 for row in result["rows"])
    assert (tmp_path / "eagle3_gpu.json").exists()


def test_a_head_runs_whole_beside_rank_zero(llama_head):
    """Two ranks: the target's hidden states are kept on rank 0 (whole there after each
    layer's all-reduce) and the head runs whole beside it; greedy output is one rank's."""
    from tests.backend_gpu.test_tensor_parallel import assert_same_greedy, prompts, reference

    target, head = llama_head
    one = LLM(target)
    prompt_ids = prompts(one.tokenizer)
    refs = reference(one, prompt_ids)
    two = LLM(target, tensor_parallel_size=2, speculative_config=eagle3(head))
    try:
        assert_same_greedy(two, refs, prompt_ids)
        assert two.stats().num_drafts > 0
        proposer = two.engine.speculator.proposer
        assert proposer.runner.ranks is None and proposer.runner.kv_shape == (2, 16)
        assert two.engine.runner.aux_states is not None
    finally:
        two.engine.close()


def test_adapter_requests_decode_plainly_beside_drafted_ones(tiny_model_dir, tmp_path):
    """The head knows the base model only: an adapter's request decodes one token a
    step (no rows kept for it), a base request in the same batch is drafted for."""
    from tests.backend_gpu.lora_adapters import save_random_adapter
    from tests.requests import req

    target = tiny_model_dir("llama")
    head = write_random_head(target, str(tmp_path / "h"))
    adapter = AdapterRef("a", str(tmp_path / "a"))
    save_random_adapter(target, adapter.path, r=8, targets=["q_proj", "v_proj"])
    opts = {"enable_lora": True, "kv_cache_memory_bytes": 1 << 23}
    prompt = copy_prompts(LLM(target).tokenizer)[0]

    def run(llm):
        engine = llm.engine
        for rid, ref in (("lora", adapter), ("base", None)):
            engine.add_request(dataclasses.replace(req(rid, prompt, GREEDY), adapter=ref))
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out.token_ids
                if out.request_id == "lora" and engine.speculator is not None:
                    assert "lora" not in engine.speculator.proposer.states
        return outs

    want = run(LLM(target, **opts))
    spec = LLM(target, **opts, speculative_config=eagle3(head))
    assert run(spec) == want
    assert want["lora"] != want["base"]
    assert spec.stats().num_drafts > 0
