"""LoRA beyond the plain path: bad adapters refused by name and changing nothing, the
torch path and the Triton kernels (in the interpreter) computing the same delta, FP8
base weights under an adapter, n-gram speculation under an adapter, the async checks."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_gpu.async_engine import AsyncLLM
from backend_gpu.layers.triton_lora import lora_expand_ref, lora_shrink_ref
from backend_gpu.llm import LLM
from backend_gpu.lora.ops import (
    Batched,
    SlotsOnHost,
    StepSlots,
    add_lora,
    add_lora_packed,
    group_rows,
    regroup,
)
from backend_gpu.lora.stacks import PackedA
from engine_api.errors import BadRequestError
from engine_api.records import AdapterRef, GenRequest
from engine_api.sampling import SamplingParams
from tests.backend_gpu.lora_adapters import save_random_adapter

PROMPT = [1, *range(40, 62)]


@pytest.fixture(scope="module")
def llama_adapter(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    path = str(tmp_path_factory.mktemp("lora") / "good")
    save_random_adapter(model, path, r=8, targets=["q_proj", "v_proj", "o_proj", "down_proj"])
    return model, AdapterRef("good", path)


def run(engine, requests):
    for req in requests:
        engine.add_request(req)
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {out.request_id: out for out in engine.step() if out.finished}
    return outs


def greedy(rid, adapter, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return GenRequest(rid, "", PROMPT, params, adapter=adapter)


def _variant(good: AdapterRef, root, name: str, config=None, tensors=None) -> AdapterRef:
    """A copy of `good` with its config updated by `config` and its tensors by `tensors`."""
    path = os.path.join(root, name)
    shutil.copytree(good.path, path)
    if config:
        with open(os.path.join(path, "adapter_config.json")) as f:
            data = json.load(f)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(data | config, f)
    if tensors:
        file = os.path.join(path, "adapter_model.safetensors")
        save_file(tensors(load_file(file)), file)
    return AdapterRef(name, path)


def _narrow_one(tensors: dict) -> dict:
    key = next(k for k in tensors if "lora_B" in k)
    return tensors | {key: tensors[key][:-4].contiguous()}


def _embedding_tensor(tensors: dict) -> dict:
    key = "base_model.model.model.embed_tokens.lora_embedding_A"
    return tensors | {key: torch.zeros(8, 384)}


def test_bad_adapters_refused_by_name_and_change_nothing(llama_adapter, tmp_path):
    model, good = llama_adapter
    bad = {
        "no such directory": AdapterRef("missing", str(tmp_path / "nowhere")),
        "DoRA": _variant(good, tmp_path, "dora", {"use_dora": True}),
        "modules_to_save": _variant(good, tmp_path, "save", {"modules_to_save": ["lm_head"]}),
        "bias 'all'": _variant(good, tmp_path, "bias", {"bias": "all"}),
        "embed_tokens": _variant(good, tmp_path, "embed", {"target_modules": ["embed_tokens"]}),
        "embedding and LM head": _variant(good, tmp_path, "emb2", tensors=_embedding_tensor),
        "rank_pattern": _variant(good, tmp_path, "pattern", {"rank_pattern": {"q_proj": 4}}),
        "above max_lora_rank 8": _variant(good, tmp_path, "rank", {"r": 16}),
        "do not fit the base model": _variant(good, tmp_path, "shape", tensors=_narrow_one),
    }
    engine = LLM(model, enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=1 << 23).engine
    for problem, ref in bad.items():
        with pytest.raises(BadRequestError, match=problem):
            engine.add_request(greedy(problem, ref))
        with pytest.raises(BadRequestError, match=problem):
            engine.check_adapter(ref)
    assert not engine.has_unfinished_requests() and not engine.seqs
    stats = engine.stats()
    assert stats.adapters_loaded == [] and stats.lora_loads == 0 and stats.waiting == 0
    plain = LLM(model, kv_cache_memory_bytes=1 << 23).engine
    with pytest.raises(BadRequestError, match="without enable_lora"):
        plain.add_request(greedy("x", good))


def _stacks(slots: int, rank: int, k: int, n: int):
    torch.manual_seed(0)
    a, b = torch.randn(slots, rank, k), torch.randn(slots, n, rank)
    ranks = [rank, rank // 2, rank, rank // 4]
    for slot, r in enumerate(ranks):  # a smaller rank is padded with zeros
        a[slot, r:], b[slot, :, r:] = 0, 0
    scale = torch.tensor([0.5, 2.0, 1.5, 3.0])
    return a, b, scale, SlotsOnHost(ranks, scale.tolist())


@pytest.mark.parametrize(
    ("kernels", "batched"),
    [(False, False), (False, True), (True, False)],
    ids=["torch-per-adapter", "torch-batched", "triton-interpreter"],
)
def test_torch_path_and_kernels_compute_the_reference(kernels, batched):
    # slot 3 in two runs; slot 1 unused (in the batched path's slot range: all padding)
    seq_slots, num_new = [3, -1, 0, 3, 2, -1], [5, 1, 3, 1, 4, 2]
    a, b, scale, host = _stacks(4, 8, 32, 24)
    x = torch.randn(sum(num_new), 32)
    idx = torch.tensor(
        [s for s, n in zip(seq_slots, num_new, strict=True) for _ in range(n)], dtype=torch.int32
    )
    wide = torch.randn(len(x), 40)
    expected = wide.clone()
    lora_expand_ref(expected[:, 8:32], lora_shrink_ref(x, a, idx), b, idx, scale)
    groups = group_rows(seq_slots, num_new)
    step = StepSlots(kernels=kernels, idx=idx, host_groups=groups)
    if batched:  # the groups padded to one shape
        step.batched = Batched.of(groups)
        assert step.batched is not None and step.batched.real is not None
    regroup(step, len(x), 4)
    add_lora(wide[:, 8:32], x, a, b, scale, step, host)  # a column range, as q, k or v
    torch.testing.assert_close(wide, expected)
    assert not torch.equal(wide, torch.randn(len(x), 40))


def test_packed_subs_shrink_at_once_as_each_alone():
    """q/k/v through one gather and one shrink (add_lora_packed) equal each sub through
    add_lora, with ragged ranks, a sub an adapter leaves alone, and padded groups."""
    seq_slots, num_new = [3, -1, 0, 3, 2, -1], [1, 1, 1, 1, 2, 1]
    groups = group_rows(seq_slots, num_new)
    batched = Batched.of(groups)
    assert batched is not None and batched.real is not None
    step = StepSlots(kernels=False, idx=torch.empty(0), host_groups=groups, batched=batched)
    x, widths = torch.randn(sum(num_new), 32), [24, 8, 8]
    packed = PackedA(32, len(widths), slots=4, rank=8, dtype=torch.float32, device="cpu")
    parts, expected, start = [], torch.randn(len(x), sum(widths)), 0
    out = expected.clone()
    for i, width in enumerate(widths):
        a, b, scale, host = _stacks(4, 8, 32, width)
        if i == 1:  # the adapter in slot 0 leaves k alone
            a[0], b[0], host.ranks[0] = 0, 0, 0
        packed.view(i).copy_(a)
        cols = slice(start, start + width)
        add_lora(expected[:, cols], x, a, b, scale, step, host)
        parts.append((b, cols))
        start += width
    add_lora_packed(out, x, packed.a, parts, scale, batched, rank=8)
    torch.testing.assert_close(out, expected)


def test_fp8_base_weights_with_an_adapter(llama_adapter):
    model, ref = llama_adapter
    llm = LLM(model, quantization="fp8", enable_lora=True, kv_cache_memory_bytes=1 << 23)
    engine = llm.engine
    outs = run(engine, [greedy("a", ref), greedy("base", None)])
    assert outs["a"].token_ids != outs["base"].token_ids
    # the offline API takes the adapter too
    (offline,) = llm.generate([PROMPT], greedy("", None).sampling, adapter=ref)
    assert offline.token_ids == outs["a"].token_ids
    # layer 0's fused qkv: the 8-bit projection's output plus exactly PEFT's delta on q, v
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, 64)
    engine.runner.lora.set_step([0], [3])
    got = qkv(x)
    expected = qkv.base(x)
    tensors = load_file(os.path.join(ref.path, "adapter_model.safetensors"))
    for proj, cols in (("q_proj", slice(0, 64)), ("v_proj", slice(96, 128))):
        stem = f"base_model.model.model.layers.0.self_attn.{proj}"
        a, b = tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"]
        expected[:, cols] += (x @ a.T @ b.T) * (16 / 8)
    torch.testing.assert_close(got, expected)


def test_ngram_speculation_under_an_adapter_changes_nothing(llama_adapter):
    model, ref = llama_adapter
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    kwargs = dict(enable_lora=True, kv_cache_memory_bytes=1 << 23)
    plain = run(LLM(model, **kwargs).engine, [greedy("a", ref, 24), greedy("b", None, 24)])
    engine = LLM(model, speculative_config=spec, **kwargs).engine
    fast = run(engine, [greedy("a", ref, 24), greedy("b", None, 24)])
    assert [fast[r].token_ids for r in "ab"] == [plain[r].token_ids for r in "ab"]
    assert engine.stats().num_drafts > 0


async def test_async_check_and_remove(llama_adapter, tmp_path):
    model, good = llama_adapter
    engine = AsyncLLM(model, enable_lora=True, kv_cache_memory_bytes=1 << 23)
    try:
        await engine.check_adapter(good)
        dora = _variant(good, tmp_path, "dora", {"use_dora": True})
        with pytest.raises(BadRequestError, match="DoRA"):
            await engine.check_adapter(dora)
        async for out in engine.generate(greedy("1", good, 4)):
            last = out
        assert last.finished and engine.engine.stats().adapters_loaded == ["good"]
        await engine.remove_adapter("good")
        assert engine.engine.stats().adapters_loaded == []
    finally:
        await engine.shutdown()


def test_two_ranks_apply_adapters_as_one_does(llama_adapter, tmp_path):
    """Column-parallel (q, v, gate, up) and row-parallel (o, down) projections: each rank
    holds its share of the adapter, and the all-reduce adds the deltas' partial sums."""
    model, ref = llama_adapter
    other = AdapterRef("all", str(tmp_path / "all"))
    save_random_adapter(model, other.path, r=4, targets="all-linear", rslora=True, seed=3)
    requests = [greedy("a", ref), greedy("b", other), greedy("base", None)]
    kwargs = dict(enable_lora=True, max_loras=2, kv_cache_memory_bytes=1 << 23)
    one = run(LLM(model, **kwargs).engine, requests)
    two_ranks = LLM(model, tensor_parallel_size=2, **kwargs).engine
    try:
        two = run(two_ranks, [greedy(r.request_id, r.adapter) for r in requests])
    finally:
        two_ranks.close()
    assert {k: v.token_ids for k, v in two.items()} == {k: v.token_ids for k, v in one.items()}
    assert len({tuple(v.token_ids) for v in one.values()}) == 3
