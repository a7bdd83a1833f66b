"""LoRA on Phi-3, whose checkpoint and transformers model fuse q/k/v into `qkv_proj` and
gate/up into `gate_up_proj`: PEFT adapts those as one module each, and the engine applies
them as their parts (each with the module's A and its rows of B). Greedy output and
logprobs equal transformers with PEFT's, alone, on two ranks and beside a Llama-style
unfused adapter target; a fused target on a base that has none is refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_gpu.lora.peft_files import BaseShapes, inspect
from engine_api.errors import BadRequestError
from engine_api.records import AdapterRef, GenRequest
from engine_api.sampling import SamplingParams
from tests.backend_gpu.lora_adapters import peft_greedy, save_random_adapter
from tests.backend_gpu.reference import assert_greedy_matches
from tests.backend_gpu.test_lora import MAX_TOKENS, lora_engine

# past the tiny Phi-3's 32 original positions, where transformers rotates by LongRoPE's
# long factors, as the engine does at its context of 256 (test_phi3.py)
PROMPTS = [[1, *range(40, 80)], [1, *range(100, 137)], [1, *range(200, 260)]]
# PEFT's "all-linear" on Phi-3 is qkv_proj, o_proj, gate_up_proj, down_proj
ADAPTERS = [
    dict(r=8, alpha=16, targets="all-linear"),
    dict(r=4, alpha=8, targets=["qkv_proj", "gate_up_proj"], rslora=True, seed=2),
]


@pytest.fixture(scope="module")
def phi3_adapter(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-phi3")

    def make(i: int) -> tuple[str, AdapterRef]:
        model = tiny_model_dir("phi3")
        path = save_random_adapter(model, str(root / f"phi3-{i}"), **ADAPTERS[i])
        return model, AdapterRef(f"phi3-{i}", path)

    return make


def generate(engine, ref: AdapterRef) -> dict:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(GenRequest(str(j), "", prompt, params, adapter=ref))
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {out.request_id: out for out in engine.step() if out.finished}
    return outs


def check_against_peft(outs: dict, expected: list, base: list) -> None:
    for j, ((ids, logits), (_, base_logits)) in enumerate(zip(expected, base, strict=True)):
        assert_greedy_matches(outs[str(j)].token_ids, ids, logits)
        ours = torch.tensor([lp.logprob for lp in outs[str(j)].logprobs])
        theirs = logits.log_softmax(-1)[torch.arange(MAX_TOKENS), ids]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
        # the adapter changes the output (else ignoring it would pass)
        assert (logits[0] - base_logits[0]).abs().max() > 0.05


@pytest.mark.parametrize("i", [0, 1])
def test_fused_targets_equal_peft(phi3_adapter, i):
    model, ref = phi3_adapter(i)
    keys = load_file(f"{ref.path}/adapter_model.safetensors")
    assert any(".self_attn.qkv_proj.lora_A" in k for k in keys)
    assert any(".mlp.gate_up_proj.lora_B" in k for k in keys)
    expected = peft_greedy(model, ref.path, PROMPTS, MAX_TOKENS)
    base = peft_greedy(model, None, PROMPTS, MAX_TOKENS)
    check_against_peft(generate(lora_engine(model), ref), expected, base)


def test_fused_targets_split_over_two_ranks_equal_peft(phi3_adapter):
    """Each rank holds its heads' rows of q, k and v and its share of gate and up: the
    fused B is cut by the parts' rows, then by the rank's."""
    model, ref = phi3_adapter(0)
    expected = peft_greedy(model, ref.path, PROMPTS, MAX_TOKENS)
    base = peft_greedy(model, None, PROMPTS, MAX_TOKENS)
    check_against_peft(generate(lora_engine(model, tensor_parallel_size=2), ref), expected, base)


def test_a_fused_target_on_an_unfused_base_is_refused_by_name(
    phi3_adapter, tiny_model_dir, tmp_path
):
    """A Phi-3 adapter offered to a Llama (which has q_proj, k_proj, v_proj apart): refused
    naming the fused module, nothing loaded."""
    from transformers import AutoConfig

    _, ref = phi3_adapter(1)
    config = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    with pytest.raises(BadRequestError, match="layer 0 gate_up_proj: the base model has no fused"):
        inspect(ref, BaseShapes.of(config), max_rank=16)


def test_an_adapter_of_a_fused_module_and_its_part_is_refused(phi3_adapter, tmp_path):
    model, ref = phi3_adapter(1)
    path = tmp_path / "both"
    shutil.copytree(ref.path, path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    stem = "base_model.model.model.layers.0.self_attn"
    a = tensors[f"{stem}.qkv_proj.lora_A.weight"]
    tensors[f"{stem}.q_proj.lora_A.weight"] = a.clone()
    tensors[f"{stem}.q_proj.lora_B.weight"] = torch.zeros(a.shape[1], a.shape[0])
    save_file(tensors, str(path / "adapter_model.safetensors"))
    from transformers import AutoConfig

    with pytest.raises(BadRequestError, match="both fused and as its part q_proj"):
        inspect(AdapterRef("both", str(path)), BaseShapes.of(AutoConfig.from_pretrained(model)), 16)
