"""The runner's persistent step buffers, the padding CUDA graphs run with, how models are
built (in their dtype, one rotary table), and the engine settings that choose the
device: everything of the GPU path that a CPU can check. The graphs themselves, the
memory profile and W8A8 run in test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from backend_gpu import LLM, SamplingParams
from backend_gpu.config import EngineConfig, auto_device
from backend_gpu.cuda_graphs import capture_sizes
from backend_gpu.layers.rotary import RotaryEmbedding
from backend_gpu.loader import build_model, open_model
from backend_gpu.sampler import read_back
from tests.backend_gpu.test_correctness import check, mixed_prompts
from tests.requests import req

# without it the padded steps below run the Triton kernels in the interpreter (conftest)
CUDA = torch.cuda.is_available()
BUFFERS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "sample_rows",
    "block_tables",
    "context_lens",
    "query_start_loc",
)


def test_the_same_buffers_serve_every_step(tiny_model_dir):
    """Prefill, chunked prefill, decodes and preemption: every step's inputs are views
    of the buffers allocated at start, and the outputs stay transformers'."""
    model_dir = tiny_model_dir("llama")
    # 8 blocks: the longest request fits, the batch does not (preemption); 24-token chunks
    llm = LLM(
        model_dir,
        kv_cache_memory_bytes=8 * 8192,
        max_model_len=128,
        max_num_batched_tokens=24,
        device="cpu",
    )
    runner = llm.engine.runner
    buffers = runner.buffers
    start = {
        name: (buffers.host[name].data_ptr(), buffers.dev[name].data_ptr()) for name in BUFFERS
    }
    seen: list[dict[str, int]] = []
    kinds: set[str] = set()
    prepare = runner.prepare

    def prepare_and_record(batch, graph_size, prompt_rows):
        prepared = prepare(batch, graph_size, prompt_rows)
        input_ids, positions, meta, sample_rows, _ = prepared
        seen.append(
            {
                "input_ids": input_ids.data_ptr(),
                "positions": positions.data_ptr(),
                "slot_mapping": meta.slot_mapping.data_ptr(),
                "sample_rows": sample_rows.data_ptr() if sample_rows.numel() else None,
            }
        )
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if n == 1:
                kinds.add("decode")
            elif seq.num_computed_tokens + n < seq.num_prompt_tokens:
                kinds.add("chunk")
            else:
                kinds.add("prefill")
        return prepared

    runner.prepare = prepare_and_record
    check(llm, model_dir)
    assert kinds == {"decode", "chunk", "prefill"} and llm.stats().preemptions > 0
    assert runner.buffers is buffers and len(seen) == llm.stats().num_steps
    for name in BUFFERS:
        assert (buffers.host[name].data_ptr(), buffers.dev[name].data_ptr()) == start[name]
    assert buffers.dev is buffers.host  # on the CPU the model reads the host buffers
    for step in seen:
        for name, ptr in step.items():
            assert ptr in (None, start[name][1]), name
    assert runner.graphs is None and runner.num_graph_steps == 0


class EagerGraphs:
    """Stands in for DecodeGraphs on a CPU: "replays" a size by running the model on the
    buffers sliced to it, which is what the captured graph reads."""

    def __init__(self, runner, sizes: list[int]) -> None:
        self.runner, self.sizes, self.replayed = runner, sizes, []
        self.padded = 0  # steps run as a larger size than their batch

    def size_for(self, num_seqs: int) -> int | None:
        size = next((s for s in self.sizes if s >= num_seqs), None)
        self.padded += size is not None and size > num_seqs
        return size

    def replay(self, size: int) -> torch.Tensor:
        self.replayed.append(size)
        runner, dev = self.runner, self.runner.buffers.dev
        meta = runner.buffers.paged_metadata(size, size, 1, runner.block_size)
        return runner.model(dev["input_ids"][:size], dev["positions"][:size], meta)


def test_decodes_padded_to_a_graph_size_keep_their_outputs(tiny_model_dir):
    """The graph path's inputs: decodes padded with sequences of length 0 that write to
    the scratch block. Gemma 3 (sliding window, GQA) on the kernels, greedy outputs
    still transformers', and no live block touched by the padding."""
    model_dir = tiny_model_dir("gemma3")
    llm = LLM(model_dir, max_num_batched_tokens=24, max_num_seqs=5, device="cpu")
    runner = llm.engine.runner
    runner.paged_kernels = True
    runner.graphs = graphs = EagerGraphs(runner, capture_sizes(5))
    assert graphs.sizes == [1, 2, 4, 5]
    check(llm, model_dir)
    assert runner.num_graph_steps == len(graphs.replayed) > 0
    assert graphs.padded > 0
    assert runner.scratch_slot == llm.engine.block_manager.num_blocks * runner.block_size

    # one padded decode step by hand: the padding rows are decodes of nothing
    engine = llm.engine
    for i, prompt in enumerate(mixed_prompts()[:3]):
        engine.add_request(req(str(i), prompt, SamplingParams(temperature=0, max_tokens=4)))
    while not engine.scheduler.running or any(
        len(s) - s.num_computed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [1, 1, 1]
    want = runner.run(batch).logits  # 3 sequences run as 4
    host = runner.buffers.np
    assert host["slot_mapping"][3] == runner.scratch_slot and host["context_lens"][3] == 0
    live = [attn.k_cache[: runner.scratch_slot].clone() for attn in runner.attention_layers]
    runner.graphs = None
    got = runner.run(batch).logits  # the same step unpadded, eager
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the live slots hold what they held (rewritten by a GEMM of 3 rows, not 4: equal up
    # to rounding); a padding row written into one would differ by far more
    for attn, before in zip(runner.attention_layers, live, strict=True):
        torch.testing.assert_close(attn.k_cache[: runner.scratch_slot], before)


def test_capture_sizes_cover_every_batch():
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_sizes(300)[-4:] == [256, 272, 288, 300]
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(1) == [1]


class LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any op makes off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.dtype == torch.float32:
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_model_is_built_in_its_dtype_with_one_rotary_table(tiny_model_dir, arch):
    hf_config, _, weights = open_model(tiny_model_dir(arch))
    with LargestFloat32() as made:
        model = build_model(hf_config, torch.bfloat16, torch.device("cpu"), weights, "dummy", 3)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # only the rotary tables are float32 (a float32 build would make embedding-sized ones)
    head_dim = model.model.layers[0].self_attn.head_dim
    assert made.numel <= hf_config.max_position_embeddings * head_dim
    rotaries = {id(layer.self_attn.rotary) for layer in model.model.layers}
    tables = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(rotaries) == len(tables) == (2 if arch == "gemma3" else 1)  # local, global
    assert all(t.cos.dtype == torch.float32 and t.cos.shape == (256, head_dim) for t in tables)
    # tied parameters stay one tensor; dummy weights are seeded
    if arch == "gemma3":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    again = build_model(hf_config, torch.bfloat16, torch.device("cpu"), weights, "dummy", 3)
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)


def test_rotary_tables_are_the_checkpoint_independent_ones(tiny_model_dir):
    """Recomputed after the meta build: the same cos and sin as a table made directly."""
    llm = LLM(tiny_model_dir("gemma3"), device="cpu")
    for layer in llm.engine.runner.model.model.layers:
        rotary = layer.self_attn.rotary
        fresh = RotaryEmbedding(*rotary.settings)
        assert torch.equal(rotary.cos, fresh.cos) and torch.equal(rotary.sin, fresh.sin)


def test_dummy_weights_replace_the_checkpoint(tiny_model_dir):
    path = tiny_model_dir("llama")
    real = LLM(path).engine.runner.model
    dummy = LLM(path, load_format="dummy", seed=5)
    weight = dummy.engine.runner.model.model.layers[0].mlp.down_proj.weight
    assert not torch.equal(weight, real.model.layers[0].mlp.down_proj.weight)
    assert abs(weight.std().item() - 0.02) < 0.005
    out = dummy.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5


def test_device_and_dtype_resolve_once():
    assert auto_device() == ("cuda" if CUDA else "cpu")
    config = EngineConfig(model="m")  # "auto" is the CPU in unmarked tests (conftest.py)
    assert (config.device, config.dtype) == ("cpu", "float32")
    if CUDA:
        assert EngineConfig(model="m", device="cuda").dtype == "bfloat16"
    assert EngineConfig(model="m", device="cpu", dtype="bfloat16").dtype == "bfloat16"
    for options, error in (
        ({"device": "tpu"}, "device must be auto, cpu or cuda"),
        ({"device": "cpu", "dtype": "float16"}, "float16 is for CUDA"),
        ({"dtype": "float64"}, "dtype must be auto, float32"),
        ({"load_format": "pt"}, "load_format must be"),
    ):
        with pytest.raises(ValueError, match=error):
            EngineConfig(model="m", **options)
    if not CUDA:
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            EngineConfig(model="m", device="cuda")


def test_read_back_leaves_host_tensors_alone():
    a, b = torch.arange(3), torch.ones(2)
    got = read_back(a, b)
    assert got[0] is a and got[1] is b
