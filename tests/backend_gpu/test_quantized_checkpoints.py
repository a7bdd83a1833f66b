"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) load quantized and compute
what the format's own dequantization says: a tiny random model written in each format
(quantized_checkpoints.py) against the same checkpoint dequantized by the format's
reference code and run in transformers. Greedy tokens equal (under the near-tie rule);
the top log-probabilities within LOGPROB_TOLERANCE (float32 both: the same weights, only
the order of the sums differs). A checkpoint whose config and tensors disagree fails at
start naming the tensor; other quantization methods are refused by name."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_gpu import LLM, SamplingParams
from backend_gpu.layers.linear import QuantizedLinear
from backend_gpu.layers.packed_weight_linear import PackedEmbedding, PackedWeightLinear
from backend_gpu.quantization.checkpoint_config import UnsupportedQuantization
from tests.backend_gpu.quantized_checkpoints import (
    compressed_schemes,
    write_awq,
    write_compressed,
    write_gptq,
)
from tests.backend_gpu.reference import assert_greedy_matches, forced_agreement, hf_greedy
from tests.backend_gpu.test_packed_weight import KERNEL_LAYOUT_READ

MAX_NEW = 8
LOGPROB_TOLERANCE = 1e-3
PROMPTS = [[1, 5, 9, 30, 41, 7], [1, 100, 3, 77, 250, 251, 252, 8, 9, 12, 12, 12]]
FORMATS = {
    "gptq-4bit-asym-desc_act": lambda src, dst: write_gptq(src, dst, 4, 32, False, True),
    "gptq_v2-8bit-sym-channel": lambda src, dst: write_gptq(src, dst, 8, -1, True, False, v2=True),
    "awq-gemm-g32": lambda src, dst: write_awq(src, dst, 32),
    **{
        f"ct-{kind}": functools.partial(write_compressed, kind=kind)
        for kind in compressed_schemes()
    },
}
EIGHT_BIT_PER_CHANNEL = ("ct-fp8-dynamic", "ct-fp8-static-tensor", "ct-w8a8-int")
PHI3_FORMATS = (
    "ct-fp8-dynamic",
    "ct-fp8-static-tensor",
    "ct-w8a8-int",
    "gptq-4bit-asym-desc_act",
    "awq-gemm-g32",
)


@pytest.fixture(scope="module")
def written(tiny_model_dir, tmp_path_factory):
    """(arch, format) -> (quantized checkpoint, its dequantized reference), written once."""
    root = tmp_path_factory.mktemp("quantized")
    cache: dict[tuple[str, str], tuple[str, str]] = {}

    def write(arch: str, fmt: str) -> tuple[str, str]:
        if (arch, fmt) not in cache:
            dst = str(root / f"{arch}-{fmt}")
            cache[arch, fmt] = dst, FORMATS[fmt](tiny_model_dir(arch), dst)
        return cache[arch, fmt]

    return write


def assert_matches_reference(
    llm: LLM, reference_dir: str, tolerance: float = LOGPROB_TOLERANCE
) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    refs = hf_greedy(reference_dir, PROMPTS, MAX_NEW)
    for out, (ref_ids, ref_logits) in zip(llm.generate(PROMPTS, params), refs, strict=True):
        assert_greedy_matches(out.token_ids, ref_ids, ref_logits)
        ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
        for step, lp in enumerate(out.logprobs):
            if out.token_ids[: step + 1] != ref_ids[: step + 1]:
                break  # a near tie took another token: the contexts differ from here
            for token, value in lp.top:
                assert abs(value - ref_logprobs[step, token].item()) < tolerance


@pytest.mark.parametrize(
    ("arch", "fmt"),
    [("llama", fmt) for fmt in FORMATS]
    + [("gemma3", "gptq-4bit-asym-desc_act"), ("qwen2", "awq-gemm-g32")]
    # Phi-3's fused qkv_proj and gate_up_proj, each quantized whole
    + [("phi3_window", fmt) for fmt in PHI3_FORMATS],
)
def test_each_format_computes_what_its_reference_dequantization_says(written, arch, fmt):
    path, reference_dir = written(arch, fmt)
    llm = LLM(path)
    kind = QuantizedLinear if fmt in EIGHT_BIT_PER_CHANNEL else PackedWeightLinear
    model = llm.engine.runner.model
    layers = [m for m in model.model.layers.modules() if isinstance(m, kind)]
    assert len(layers) == 4 * len(model.model.layers)  # qkv, o, gate_up, down: all quantized
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    assert_matches_reference(llm, reference_dir)


def test_int4_weights_stay_packed_and_the_memory_profile_counts_their_bytes(
    written, tiny_model_dir
):
    path, _ = written("llama", "gptq-4bit-asym-desc_act")
    dense = LLM(tiny_model_dir("llama")).engine.runner
    quant = LLM(path).engine.runner
    dense_layers = dict(dense.model.named_modules())
    saved = 0
    for name, layer in quant.model.named_modules():
        if not isinstance(layer, PackedWeightLinear):
            continue
        n, k = layer.out_features, layer.in_features
        assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (k // 8, n)
        held = sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))
        bias = 0 if layer.bias is None else layer.bias.numel() * 4
        # 4 bits a weight; fp16 scales and uint8 zeros per group of 32 rows; g_idx
        assert held - bias == k * n // 2 + (k // 32) * n * 3 + k * 4
        saved += dense_layers[name].weight.numel() * 4 - (held - bias)
    assert saved > 0 and quant.weight_bytes == dense.weight_bytes - saved


def test_bfloat16_runs_the_packed_int4_matmul_and_agrees(written):
    path, _ = written("llama", "gptq-4bit-asym-desc_act")
    ref = LLM(path).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    llm = LLM(path, dtype="bfloat16")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedWeightLinear)]
    assert layers and all(m.cpu_int4 for m in layers)
    assert forced_agreement(llm, PROMPTS, ref) >= 0.8


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_a_quantized_token_table_stays_packed_and_is_held_once_where_tied(written, arch):
    """compressed-tensors W4A16 with the token table quantized too (studies/gptq_w4a16.py
    --table): Gemma 3 ties its table, so one packed table is the lookup and the head;
    Llama's (untied here) are two. Both compute the library's dequantization."""
    path, reference_dir = written(arch, "ct-w4a16-table")
    llm = LLM(path)
    model = llm.engine.runner.model
    embed, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embed, PackedEmbedding) and isinstance(head, PackedWeightLinear)
    assert (embed.table is head) == (arch == "gemma3")
    vocab, hidden = head.out_features, head.in_features
    assert head.qweight.shape == (hidden // 8, vocab) and head.qweight.dtype == torch.int32
    assert not any(p.numel() >= vocab * hidden for p in model.parameters())  # nothing wide
    assert_matches_reference(llm, reference_dir)


def test_a_quantized_table_in_bfloat16_reads_the_cpu_kernels_layout_and_agrees(written):
    path, _ = written("gemma3", "ct-w4a16-table")
    ref = LLM(path).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    llm = LLM(path, dtype="bfloat16")
    # 384 tokens: whole 64-row blocks, read back where torch packs the AVX-512 layout
    assert llm.engine.runner.model.lm_head.cpu_int4 == KERNEL_LAYOUT_READ
    assert forced_agreement(llm, PROMPTS, ref) >= 0.8


def test_two_ranks_decode_what_one_does(written):
    """Row-parallel layers with act-order: each rank holds its rows of g_idx and every
    group's scales and zeros."""
    path, _ = written("llama", "gptq-4bit-asym-desc_act")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    one = [o.token_ids for o in LLM(path).generate(PROMPTS, params)]
    two = [o.token_ids for o in LLM(path, tensor_parallel_size=2).generate(PROMPTS, params)]
    assert two == one


@pytest.mark.parametrize("fmt", ["ct-fp8-static-tensor", "gptq-4bit-asym-desc_act"])
def test_two_ranks_cut_each_part_of_a_fused_quantized_tensor(written, fmt):
    """Phi-3's qkv_proj read whole and cut to each rank's q, k and v rows: one scale
    for the whole tensor (FP8), act-order's g_idx shared by its parts (GPTQ)."""
    path, _ = written("phi3_window", fmt)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    one = [o.token_ids for o in LLM(path).generate(PROMPTS, params)]
    two = LLM(path, tensor_parallel_size=2)
    qkv = two.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.out_features == (64 + 32 + 32) // 2  # this rank's heads of q, k and v
    assert [o.token_ids for o in two.generate(PROMPTS, params)] == one


def test_two_ranks_split_a_quantized_table_over_the_vocabulary(written):
    path, _ = written("gemma3", "ct-w4a16-table")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    one = LLM(path).generate(PROMPTS, params)
    two = LLM(path, tensor_parallel_size=2).generate(PROMPTS, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def _broken_copy(path: str, dst: str, edit_tensors=None, edit_config=None) -> str:
    os.makedirs(dst)
    for name in os.listdir(path):
        src = os.path.join(path, name)
        if name == "model.safetensors":
            tensors = load_file(src)
            if edit_tensors is not None:
                edit_tensors(tensors)
            save_file(tensors, os.path.join(dst, name))
        elif name == "config.json":
            with open(src) as f:
                config = json.load(f)
            if edit_config is not None:
                edit_config(config["quantization_config"])
            with open(os.path.join(dst, name), "w") as f:
                json.dump(config, f)
        else:
            with open(src, "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    return dst


DOWN = "model.layers.1.mlp.down_proj"
QKV = "model.layers.0.self_attn.qkv_proj"


def _unquantize_down(tensors: dict) -> None:
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        tensors.pop(f"{DOWN}.{name}")
    tensors[f"{DOWN}.weight"] = torch.zeros(64, 128)


BROKEN = {
    "missing-qzeros": (
        dict(edit_tensors=lambda t: t.pop(f"{DOWN}.qzeros")),
        ValueError,
        f"{DOWN}.qzeros is missing",
    ),
    "wrong-scales-shape": (
        dict(edit_tensors=lambda t: t.update({f"{DOWN}.scales": t[f"{DOWN}.scales"][:2]})),
        ValueError,
        f"{DOWN}.scales: torch.float16 \\(2, 64\\)",
    ),
    "a-layer-left-unquantized": (
        dict(edit_tensors=_unquantize_down),
        ValueError,
        f"{DOWN}.weight: unquantized in the checkpoint, but its gptq quantization_config",
    ),
    "a-bias-the-model-lacks": (
        dict(edit_tensors=lambda t: t.update({f"{DOWN}.bias": torch.ones(64)})),
        ValueError,
        f"{DOWN}.bias: the model has no bias there",
    ),
    "config-says-8-bits": (
        dict(edit_config=lambda c: c.update(bits=8)),
        ValueError,
        r"model.layers.0.mlp.down_proj.qweight: torch.int32 \(16, 64\) .* expected .* \(32, 64\)",
    ),
    "3-bits": (
        dict(edit_config=lambda c: c.update(bits=3)),
        UnsupportedQuantization,
        "gptq with 3 bits is not supported; supported: gptq",
    ),
    "bitsandbytes": (
        dict(edit_config=lambda c: c.update(quant_method="bitsandbytes")),
        UnsupportedQuantization,
        "'bitsandbytes' is not supported; supported: gptq .* awq .* compressed-tensors",
    ),
    "marlin-export": (
        dict(edit_config=lambda c: c.update(checkpoint_format="marlin")),
        UnsupportedQuantization,
        "gptq with checkpoint_format 'marlin'",
    ),
}


def test_a_fused_tensor_whose_scale_disagrees_fails_at_start_naming_it(written, tmp_path):
    """One scale for each of q's rows alone is neither per channel of the fused tensor
    nor per tensor."""
    path, _ = written("phi3_window", "ct-fp8-dynamic")
    edit = {"edit_tensors": lambda t: t.update({f"{QKV}.weight_scale": torch.ones(64, 1)})}
    with pytest.raises(ValueError, match=f"{QKV}.weight_scale: torch.float32 \\(64, 1\\)"):
        LLM(_broken_copy(path, str(tmp_path / "broken"), **edit))


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_checkpoint_that_disagrees_with_its_config_fails_at_start(written, tmp_path, case):
    path, _ = written("llama", "gptq-4bit-asym-desc_act")
    edits, error, match = BROKEN[case]
    with pytest.raises(error, match=match):
        LLM(_broken_copy(path, str(tmp_path / case), **edits))


def _second_table_copy(tensors: dict) -> None:
    for name in [n for n in tensors if n.startswith("model.embed_tokens.")]:
        tensors["lm_head." + name.rpartition(".")[2]] = tensors[name].clone()


def _fp8_config(config: dict) -> None:
    """The table as an FP8-per-channel group of its own, first (the first match wins)."""
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    table = {"targets": ["Embedding"], "format": "float-quantized", "weights": weights}
    config["config_groups"] = {"table": table, **config["config_groups"]}


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(edit_tensors=_second_table_copy), "a second copy of a token table the model ties"),
        (dict(edit_config=_fp8_config), "model.embed_tokens: a token table quantized as"),
    ],
    ids=["both-roles-of-a-tied-table", "an-8-bit-per-channel-table"],
)
def test_a_quantized_table_the_engine_cannot_hold_fails_at_start(written, tmp_path, edit, match):
    path, _ = written("gemma3", "ct-w4a16-table")
    with pytest.raises(ValueError, match=match):
        LLM(_broken_copy(path, str(tmp_path / "broken"), **edit))


def test_load_time_quantization_of_a_quantized_checkpoint_is_refused(written):
    path, _ = written("llama", "awq-gemm-g32")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(path, quantization="int8")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
POOL = {"kv_cache_memory_bytes": 64 << 20}  # a fixed pool: tiny engines, quick to zero


@pytest.mark.parametrize(
    "fmt",
    ["gptq-4bit-asym-desc_act", "gptq_v2-8bit-sym-channel", "awq-gemm-g32", "ct-w4a16-table"],
)
@pytest.mark.cuda
@needs_cuda
def test_packed_layers_on_cuda_run_the_int4_kernel_and_match_the_reference(written, fmt):
    """float32 on the GPU (the kernel's float32 dot may round through TF32: a looser
    tolerance), with CUDA graphs, against transformers on the CPU."""
    path, reference_dir = written("llama", fmt)
    llm = LLM(path, device="cuda", dtype="float32", **POOL)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedWeightLinear)]
    assert layers and all(m.qweight.is_cuda and not m.cpu_int4 for m in layers)
    assert_matches_reference(llm, reference_dir, tolerance=2e-2)
    assert llm.engine.runner.num_graph_steps > 0


@pytest.mark.parametrize(
    ("arch", "fmt"),
    [
        ("llama", "gptq-4bit-asym-desc_act"),
        ("llama", "ct-fp8-dynamic"),
        ("phi3_window", "gptq-4bit-asym-desc_act"),
        ("phi3_window", "ct-fp8-static-tensor"),
    ],
)
@pytest.mark.cuda
@needs_cuda
def test_bfloat16_on_cuda_agrees_with_float32_on_the_cpu(written, arch, fmt):
    """The INT4 kernel, and FP8 weights on _scaled_mm with per-token activation scales
    where the GPU has FP8 (W8A8); Phi-3's fused tensors quantized whole."""
    path, _ = written(arch, fmt)
    refs = LLM(path).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    llm = LLM(path, device="cuda", dtype="bfloat16", **POOL)
    if fmt == "ct-fp8-dynamic" and torch.cuda.get_device_capability() >= (8, 9):
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert linears and all(m.w8a8 for m in linears)
    assert forced_agreement(llm, PROMPTS, refs) >= 0.8
