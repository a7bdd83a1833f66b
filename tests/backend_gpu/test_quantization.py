"""FP8 and INT8 weights, the FP8 KV cache, and their flags through the gateway."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backend_gpu import LLM, SamplingParams
from backend_gpu.config import EngineConfig
from backend_gpu.layers.linear import (
    PackedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedLMHead,
)
from backend_gpu.quantization import QUANTIZE_PER_CHANNEL, fp8, int8
from backend_gpu.quantization.fp8 import FP8
from gateway.backends import build_backend
from gateway.cli import main as kvgate_main
from gateway.config_load import load_settings
from tests.backend_gpu.conftest import GEMMA3_270M_GROUP
from tests.backend_gpu.reference import forced_agreement

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 9, 30, 41, 7], [100, 3, 77], [12] * 20, [250, 251, 252, 253, 254, 255, 8, 9]]
# the largest error of one weight: FP8 keeps 3 mantissa bits (relative to the weight),
# INT8 half a step of 1/127 of its row's largest weight
WEIGHT_TOLERANCE = {"fp8": 2**-4, "int8": 0.5 / 127}


def test_the_cpus_fp8_widening_gives_torchs_values_and_products():
    """fp8.widen_scaled (the CPU's vectorized widening, the quantizer's and a weight-only
    layer's) gives every finite E4M3 code torch's own value, and a layer the products of
    torch's widening bit for bit, in both float dtypes the CPU serves."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    want = codes.to(torch.float32)
    finite = ~want.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(fp8.widened(codes)[finite], want[finite])
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        layer = QuantizedLinear.of(nn.Linear(64, 96).to(dtype), "fp8")
        x = torch.randn(5, 64, dtype=dtype)
        plain = nn.functional.linear(x, layer.weight.to(dtype)) * layer.weight_scale.to(dtype)
        assert torch.equal(layer(x), plain + layer.bias)


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_per_channel_weights_within_tolerance(method):
    torch.manual_seed(0)
    # rows of very different magnitudes: each needs its own scale; one row all zero
    w = torch.randn(64, 96) * torch.logspace(-3, 2, 64)[:, None]
    w[7] = 0
    q, scale = QUANTIZE_PER_CHANNEL[method](w)
    assert q.dtype == (FP8 if method == "fp8" else torch.int8)
    assert scale.shape == (64,) and scale.dtype == torch.float32
    deq = q.float() * scale[:, None]
    assert torch.isfinite(deq).all() and (deq[7] == 0).all()
    row_max = w.abs().amax(dim=1, keepdim=True)
    if method == "int8":  # uniform steps: the error is at most half a step of the row
        assert ((deq - w).abs() <= WEIGHT_TOLERANCE["int8"] * row_max * 1.0001).all()
    else:  # floating point: relative to each weight, where it is a normal FP8 number
        normal = w.abs() / scale[:, None] >= 2**-6  # FP8's smallest normal number
        rel = ((deq - w).abs() / w.abs())[normal]
        assert normal.sum() > 0.9 * normal.numel() and rel.max() <= WEIGHT_TOLERANCE["fp8"]
        assert ((deq - w).abs() <= WEIGHT_TOLERANCE["fp8"] * row_max).all()
        # each row's scale is the best of its search: no worse than amax / 448
        plain = (row_max / 448).clamp(min=1e-12)
        plain_err = ((fp8.to_fp8(w, plain).float() * plain - w) ** 2).sum(dim=1)
        assert (((deq - w) ** 2).sum(dim=1) <= plain_err).all()
        assert (((deq - w) ** 2).sum() < 0.95 * plain_err.sum()).item()


@pytest.mark.parametrize(
    ("method", "rows_at_once", "width"),
    [("fp8", fp8.ROWS_AT_ONCE, 48), ("int8", 4, int8.VALUES_AT_ONCE // 4)],
)
def test_rows_in_blocks_are_quantized_as_alone(method, rows_at_once, width):
    """The quantizers run a block of rows at a time: each row, in whichever block and
    wherever the blocks end, gets what it gets quantized on its own."""
    torch.manual_seed(0)
    rows = 2 * rows_at_once + 3
    w = (torch.randn(rows, width) * torch.logspace(-3, 2, rows)[:, None]).bfloat16()
    w[rows_at_once] = 0
    q, scale = QUANTIZE_PER_CHANNEL[method](w)
    alone = [QUANTIZE_PER_CHANNEL[method](row[None]) for row in w]
    assert torch.equal(q.view(torch.uint8), torch.cat([a[0] for a in alone]).view(torch.uint8))
    assert torch.equal(scale, torch.cat([a[1] for a in alone]))


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    kinds = (QuantizedLinear, QuantizedEmbedding, QuantizedLMHead)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each quantized module's weight as it computes with it, by the original's name."""
    weights = {}
    for name, m in quantized_modules(model).items():
        if isinstance(m, QuantizedLinear):
            weights[name] = m.weight.float() * m.weight_scale[:, None]
        elif isinstance(m, QuantizedLMHead):
            weights[name] = m.table.dequantize()
        elif not name.endswith(".table"):  # an untied head's own table: under the head
            weights[name] = m.dequantize()
    return weights


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied and tied LM head
def test_quantized_layers_match_the_originals(tiny_model_dir, arch, method):
    path = tiny_model_dir(arch)
    ref = LLM(path).engine.runner
    quant = LLM(path, quantization=method).engine.runner
    originals = dict(ref.model.named_modules())
    layers = {n: m for n, m in quantized_modules(quant.model).items() if n in originals}
    # every decoder linear (2 layers x qkv, o, gate_up, down), the embedding, the head
    assert len(layers) == 10 and isinstance(layers["lm_head"], QuantizedLMHead)
    tied = ref.model.lm_head.weight is ref.model.model.embed_tokens.weight
    assert tied == (arch == "qwen3")
    assert (quant.model.lm_head.table is quant.model.model.embed_tokens) == tied
    # the token table is INT8 under either method, a scale per 32 values of a row
    table = quant.model.lm_head.table
    assert table.weight.dtype == torch.int8 and table.weight_scale.shape[1] == 64 // 32
    torch.manual_seed(0)
    for name, layer in layers.items():
        original = originals[name]
        if isinstance(original, nn.Embedding):
            x = torch.randint(0, original.num_embeddings, (10,))
            x[0] = original.num_embeddings - 1  # the last row too
        else:
            x = torch.randn(10, original.in_features)
        want, got = original(x), layer(x)
        assert got.dtype == want.dtype == torch.float32
        err = (got - want).norm() / want.norm()
        is_table = isinstance(layer, QuantizedEmbedding | QuantizedLMHead)
        assert err < (0.01 if is_table else {"fp8": 0.05, "int8": 0.01}[method]), (name, err)
        if isinstance(original, PackedLinear):
            assert [t.shape for t in layer.split(got)] == [t.shape for t in original.split(want)]
    # honest bytes: 1 byte a weight, 4 bytes a scale, everything else as loaded; a tied
    # table is counted once
    holders = [m.table if isinstance(m, QuantizedLMHead) else m for m in layers.values()]
    unique = {id(m): m for m in holders}.values()
    saved = sum(m.weight.numel() * 3 - m.weight_scale.numel() * 4 for m in unique)
    assert quant.weight_bytes == ref.weight_bytes - saved


def test_a_token_table_needs_whole_groups():
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantizedEmbedding(torch.randn(100, 48))


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {"quantization": "fp8"}),
        ("llama", {"quantization": "int8"}),
        ("gemma3", {"quantization": "fp8"}),
        ("llama", {"kv_cache_dtype": "fp8"}),
        ("gemma3", {"kv_cache_dtype": "fp8"}),  # sliding-window layers read it too
    ],
    ids=["llama-fp8", "llama-int8", "gemma3-fp8", "llama-fp8-kv", "gemma3-fp8-kv"],
)
def test_greedy_next_tokens_agree_with_the_unquantized_model(tiny_model_dir, arch, options):
    """Teacher-forced: the next token after each prefix of the unquantized model's own
    output. (Free-running, one near-tie of these random models sends the two
    continuations apart for good.)"""
    path = tiny_model_dir(arch)
    refs = LLM(path).generate(PROMPTS, GREEDY)
    # small chunks: later chunks read the (FP8) cache back
    llm = LLM(path, max_num_batched_tokens=32, **options)
    assert forced_agreement(llm, PROMPTS, refs) >= 0.75


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_quantized_model_computes_what_its_dequantized_weights_say(tiny_llama, method):
    """The quantized engine, token for token, against the unquantized engine holding the
    dequantized weights: the 8-bit path (scales, packing, bias) adds no error of its own."""
    quant = LLM(tiny_llama, quantization=method)
    ref = LLM(tiny_llama)
    modules = dict(ref.engine.runner.model.named_modules())
    for name, weight in weights_of(quant.engine.runner.model).items():
        modules[name].weight.data.copy_(weight)
    outs = quant.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref.generate(PROMPTS, GREEDY)]


def test_w8a8_matmul_is_the_product_of_its_quantized_operands():
    """The FP8 tensor-core matmul (torch's _scaled_mm, which the CPU also implements):
    exactly the product of the per-token FP8 activations and per-channel FP8 weights with
    their scales, up to bfloat16's rounding of the output; 3-d input and a bias."""
    torch.manual_seed(1)
    x = (torch.randn(2, 5, 64) * torch.logspace(-2, 1, 5)[:, None]).to(torch.bfloat16)
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    q, scale = fp8.quantize_per_channel(w)
    out = fp8.w8a8_linear(x, q, scale, bias)
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16
    rows = x.float().reshape(-1, 64)
    x_scale = rows.abs().amax(dim=-1, keepdim=True) / fp8.FP8_MAX
    x_deq = fp8.to_fp8(rows, x_scale).float() * x_scale
    want = x_deq @ (q.float() * scale[:, None]).T + bias.float()
    torch.testing.assert_close(out.float().reshape(-1, 48), want, rtol=2**-7, atol=1e-2)


def test_w8a8_engine_agrees_with_bfloat16(tiny_llama, monkeypatch):
    """The engine on the W8A8 path, as on an FP8 GPU, here with torch's CPU _scaled_mm:
    the layers take it and greedy next tokens agree with bfloat16's (test_cuda.py runs
    the same on the GPU)."""
    refs = LLM(tiny_llama, dtype="bfloat16").generate(PROMPTS, GREEDY)
    monkeypatch.setattr(fp8, "supports_w8a8", lambda device: True)
    llm = LLM(tiny_llama, dtype="bfloat16", quantization="fp8")
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.w8a8 for m in linears)
    assert forced_agreement(llm, PROMPTS, refs) >= 0.75


def test_fp8_kv_cache_holds_twice_the_blocks_for_the_same_bytes(tiny_llama):
    budget = 1 << 20
    runners = {
        kv: LLM(
            tiny_llama, dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype=kv
        ).engine.runner
        for kv in ("auto", "fp8")
    }
    bf16, fp8 = runners["auto"], runners["fp8"]
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.kv_cache_bytes == bf16.kv_cache_bytes <= budget
    attn = fp8.attention_layers[0]
    assert attn.k_cache.dtype == attn.v_cache.dtype == FP8
    assert bf16.attention_layers[0].k_cache.dtype == torch.bfloat16
    # and it serves: all blocks back in the pool afterwards
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype="fp8")
    assert len(llm.generate(PROMPTS, GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


@pytest.mark.parametrize(
    ("capability", "allowed"), [((8, 0), False), ((8, 9), True), ((9, 0), True)]
)
def test_an_fp8_cache_needs_a_gpu_whose_kernels_read_e4m3(monkeypatch, capability, allowed):
    """The kernels read E4M3 only from Ada on (for sm_80 Triton says "type fp8e4nv not
    supported in this architecture"): an A100 gets an error at start, not at the first
    step's kernel build."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    fp8.check_fp8_kv_cache(torch.device("cpu"))  # the torch path reads it anywhere
    if allowed:
        fp8.check_fp8_kv_cache(torch.device("cuda"))
    else:
        with pytest.raises(ValueError, match=r"compute capability 8\.9 or later.*is 8\.0"):
            fp8.check_fp8_kv_cache(torch.device("cuda"))


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"quantization": "int4"}, "quantization must be None or one of"),
        ({"quantization": "FP8"}, "quantization must be"),
        ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype must be one of"),
        ({"kv_cache_dtype": None}, "kv_cache_dtype must be one of"),
    ],
)
def test_bad_values_are_rejected(options, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(model="unused", **options)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold start converts the GGUF first (cached afterwards)
@GEMMA3_270M_GROUP
def test_gemma3_270m_fp8_greedy_agrees_with_the_unquantized_model(gemma3_270m):
    from gateway.backends.default_model import default_model_path

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # the reference: float32 (bfloat16 matmuls are slow on CPUs without AVX512-BF16)
    ref = gemma3_270m
    prompt_ids = [ref.tokenizer.encode(p) for p in prompts]
    refs, ref_bytes = ref.generate(prompt_ids, params), ref.engine.runner.weight_bytes
    # the same small KV cache, which holds 112 blocks of 16 tokens in FP8
    llm = LLM(
        default_model_path(),
        kv_cache_memory_bytes=16 << 20,
        max_model_len=1024,  # the whole calibration text (482 tokens) fits
        quantization="fp8",
        kv_cache_dtype="fp8",
        max_num_batched_tokens=8,  # prefixes in chunks: the later ones read the FP8 cache
    )
    # teacher-forced, as the benchmark's "forced" column: free-running, one near-tie
    # sends the continuations apart (even bfloat16 against float32 does). 43 of 48
    # measured; a broken scale gives next to none
    assert forced_agreement(llm, prompt_ids, refs) >= 0.85
    assert llm.engine.runner.weight_bytes < 0.3 * ref_bytes  # 8-bit against float32


async def test_gateway_flags_reach_the_gpu_engine(tiny_llama, capsys):
    overrides = {"backend": "gpu", "model": tiny_llama, "quantization": "int8"}
    settings = load_settings(None, overrides | {"kv_cache_dtype": "fp8"}, environ={})
    (spec,) = settings.resolved_backends()
    assert spec.options == {"quantization": "int8", "kv_cache_dtype": "fp8"}
    backend = build_backend(spec)
    await backend.start()
    try:
        runner = backend.engine.engine.runner
        assert isinstance(runner.model.model.layers[0].mlp.down_proj, QuantizedLinear)
        assert runner.attention_layers[0].k_cache.dtype == FP8
    finally:
        await backend.stop(drain=False)
    # from the environment too
    env = {"KVGATE_BACKEND": "gpu", "KVGATE_QUANTIZATION": "fp8"}
    assert load_settings(None, environ=env).resolved_backends()[0].options == {
        "quantization": "fp8"
    }
    # a backend without them: a clear configuration error, exit status 2
    local = load_settings(None, overrides | {"backend": "local"}, environ={})
    with pytest.raises(ValueError, match="need the gpu backend"):
        local.resolved_backends()
    assert kvgate_main(["serve", "--backend", "fake", "--kv-cache-dtype", "fp8"]) == 2
    assert "need the gpu backend" in capsys.readouterr().err
