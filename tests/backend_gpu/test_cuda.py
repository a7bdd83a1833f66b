"""The engine on a CUDA GPU (skipped without one; studies/gpu_check.sh runs them): greedy
outputs of the tiny models equal transformers' on the CPU under the near-tie rule, with
CUDA graphs and without; the step buffers stay put while graphs replay; the KV cache
sized by a profiling forward; W8A8 against bfloat16."""

from __future__ import annotations

import gc

import pytest
import torch

from backend_gpu import LLM, SamplingParams
from backend_gpu.config import EngineConfig
from backend_gpu.embed_engine import EmbeddingEngine
from backend_gpu.layers.linear import QuantizedLinear
from engine_api.records import EmbedRequest
from tests.backend_gpu.embedding_models import close_to, save_tiny_qwen3_embedding
from tests.backend_gpu.reference import forced_agreement
from tests.backend_gpu.test_correctness import SETTINGS, check
from tests.backend_gpu.tiny_models import SENTENCES

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 9, 30, 41, 7], [100, 3, 77], [12] * 20, [250, 251, 252, 253, 254, 255, 8, 9]]

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# a fixed pool: the default (90% of the GPU) for every tiny engine would be slow to zero
POOL = {"kv_cache_memory_bytes": 64 << 20}


@pytest.fixture(autouse=True)
def free_the_gpu():
    """Engines of earlier tests may still hold the GPU (reference cycles): let them go,
    so each test sizes its cache against an empty device."""
    gc.collect()
    torch.cuda.empty_cache()


# mixtral, qwen3_moe, qwen2_moe: the experts' Triton grouped GEMM, in CUDA graphs for
# decodes (qwen2_moe's shared expert beside it); phi3_window: fused checkpoint tensors, a
# window on every layer; gemma3_mm: Gemma 3 as published, its text model; deepseek_v3*:
# the MLA kernel on the latent cache (decodes in CUDA graphs) and grouped routing
@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "qwen3",
        "gemma3",
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
        "phi3_window",
        "gemma3_mm",
        "gpt_oss",
        "deepseek_v3",
        "deepseek_v3_kimi",
    ],
)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_on_cuda_matches_transformers_on_the_cpu(tiny_model_dir, arch, setting):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model_dir, device="cuda", dtype="float32", **POOL, **SETTINGS[setting])
    runner = llm.engine.runner
    assert runner.paged_kernels and runner.graphs is not None
    check(llm, model_dir)
    assert runner.num_graph_steps > 0  # the decodes replayed CUDA graphs


def test_phi3_longrope_on_cuda_matches_transformers(tiny_model_dir):
    """Partial rotary and LongRoPE's long factors (prompts past the original context,
    where transformers takes them too; test_phi3.py)."""
    from tests.backend_gpu.test_phi3 import greedy_matches, long_prompts

    model_dir = tiny_model_dir("phi3")
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_batched_tokens=24, **POOL)
    greedy_matches(llm, model_dir, long_prompts())
    assert llm.engine.runner.num_graph_steps > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_greedy_on_cuda_without_graphs(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model_dir, device="cuda", dtype="float32", enforce_eager=True, **POOL)
    assert llm.engine.runner.graphs is None
    check(llm, model_dir)
    assert llm.engine.runner.num_graph_steps == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_on_cuda_under_preemption(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float32",
        kv_cache_memory_bytes=8 * 8192 if arch == "llama" else 8 * 12288,
        max_model_len=128,
        max_num_batched_tokens=32,
    )
    assert llm.stats().num_blocks == 8
    check(llm, model_dir)
    assert llm.stats().preemptions > 0 and llm.engine.runner.num_graph_steps > 0


def test_graphs_read_the_buffers_allocated_at_start(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), device="cuda", max_num_batched_tokens=24, **POOL)
    runner = llm.engine.runner
    buffers = runner.buffers
    pointers = {name: t.data_ptr() for name, t in buffers.dev.items()}
    assert all(t.is_pinned() for t in buffers.host.values())
    assert runner.graphs is not None and runner.graphs.sizes[-1] == 24
    check_outputs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in check_outputs)
    assert runner.buffers is buffers and runner.num_graph_steps > 0
    assert {name: t.data_ptr() for name, t in buffers.dev.items()} == pointers


def test_the_kv_cache_takes_what_the_profile_leaves(tiny_model_dir):
    path = tiny_model_dir("llama")
    free, total = torch.cuda.mem_get_info()
    allowed = 0.3 * total - (total - free)  # what is in use already counts
    llm = LLM(path, device="cuda", gpu_memory_utilization=0.3)
    # less the tiny weights and the profile's activations (a few MiB at 2048 tokens)
    assert allowed - (256 << 20) < llm.stats().kv_cache_bytes < allowed
    del llm
    gc.collect()
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        LLM(path, device="cuda", gpu_memory_utilization=0.001)


def test_w8a8_agrees_with_bfloat16(tiny_model_dir):
    path = tiny_model_dir("llama")
    refs = LLM(path, device="cuda", dtype="bfloat16", **POOL).generate(PROMPTS, GREEDY)
    llm = LLM(path, device="cuda", dtype="bfloat16", quantization="fp8", **POOL)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 8 and all(m.w8a8 for m in linears)  # FP8 tensor cores
    assert forced_agreement(llm, PROMPTS, refs) >= 0.75


def test_embeddings_on_cuda_equal_the_cpus(tmp_path):
    """An embedding model (a tiny Qwen3 decoder, last-token pooled) on CUDA: in float32
    its vectors are the CPU engine's (which the CPU tests hold to sentence-transformers)
    to 1e-4; in bfloat16, the engine's CUDA default, they point the same way."""
    path = save_tiny_qwen3_embedding(str(tmp_path / "tiny-qwen3-embedding"))

    def vectors(device: str, dtype: str) -> torch.Tensor:
        engine = EmbeddingEngine(EngineConfig(model=path, device=device, dtype=dtype))
        engine.add_embed(EmbedRequest("r", "tiny", [engine.tokenize(s) for s in SENTENCES]))
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = out.result
        return torch.tensor(results["r"].embeddings)

    cpu = vectors("cpu", "float32")
    close_to(vectors("cuda", "float32").tolist(), cpu)
    cosine = torch.nn.functional.cosine_similarity(vectors("cuda", "bfloat16"), cpu, dim=1)
    assert cosine.min().item() >= 0.99
