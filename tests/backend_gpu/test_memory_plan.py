"""`kvgate plan` against hand-computed figures for published shapes (Mistral 7B's GQA,
Gemma 3 270M's sliding windows, an FP8 KV cache), and against what the engine itself
allocates for a tiny model on the CPU; and the command run as a user runs it, refusing
bad input before it imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend_gpu import LLM
from backend_gpu.memory_plan import PlanDevice, PlanSettings, plan_memory
from gateway.cli.main import main as kvgate

GIB = 1 << 30
MIB = 1 << 20

# mistralai/Mistral-7B-Instruct-v0.2's config.json (the fields the engine reads)
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
# google/gemma-3-270m's config.json: 18 layers, every sixth global, the rest a 512 window
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "vocab_size": 262144,
    "sliding_window": 512,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
    ],
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "tie_word_embeddings": True,
}
H100 = PlanDevice("h100-80gb", 81_559 * MIB, 512 * MIB)


def write_config(tmp_path, values: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return str(path)


def test_mistral_7b_weights_kv_and_tp(tmp_path):
    path = write_config(tmp_path, MISTRAL_7B)
    plan = plan_memory(path, H100, PlanSettings(kv_cache_memory_bytes=16 * GIB))
    h, inter, layers, vocab, head = 4096, 14336, 32, 32000, 128
    q, kv = 32 * head, 8 * head
    linears = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]  # qkv, o, gate_up, down
    per_layer = sum(rows * cols for rows, cols in linears)
    norms = (2 * layers + 1) * h
    assert plan.parameters == layers * per_layer + 2 * vocab * h + norms == 7_241_732_096
    assert plan.weight_bytes["bfloat16"] == 2 * plan.parameters
    # 8-bit: a float32 scale per output row; the tables INT8 with a scale per 32 values
    table = vocab * h + vocab * h // 32 * 4
    rows = sum(r for r, _ in linears)
    eight_bit = layers * (per_layer + 4 * rows) + 2 * table + 2 * norms
    assert plan.weight_bytes["int8"] == plan.weight_bytes["fp8"] == eight_bit
    # int4, groups of 128: packed nibbles, a 16-bit scale and a 4-bit zero per group
    int4_layer = sum(r * c // 2 + r * (c // 128) * 2 + r * (c // 128) // 2 for r, c in linears)
    assert plan.weight_bytes["int4"] == layers * int4_layer + 2 * 2 * vocab * h + 2 * norms
    # GQA: 8 KV heads of 128 in 32 layers, a key and a value
    assert plan.kv_bytes_per_token == {"auto": 2 * 32 * 8 * 128 * 2, "fp8": 2 * 32 * 8 * 128}
    # 16 GiB of blocks of 16 tokens of 128 KiB: 8192 blocks, 4 sequences of 32768 tokens
    tp1 = plan.ranks[0]
    assert (tp1.tp_size, tp1.kv.num_blocks, tp1.max_concurrent_seqs) == (1, 8192, 4)
    assert plan.sliding_layers == 0 and plan.kv_bytes_per_seq_windowed == 32768 * 131072


def test_mistral_7b_fp8_kv_and_smallest_tp(tmp_path):
    path = write_config(tmp_path, MISTRAL_7B)
    fp8 = PlanSettings(kv_cache_memory_bytes=16 * GIB, kv_cache_dtype="fp8")
    assert plan_memory(path, H100, fp8).ranks[0].kv.num_blocks == 16384  # twice bf16's
    # 16 GiB cannot hold 13.5 GiB of weights at 0.9; split over two it holds a sequence
    small = PlanDevice("16GiB", 16 * GIB, 512 * MIB)
    plan = plan_memory(path, small, PlanSettings(max_model_len=8192))
    assert [r.fits for r in plan.ranks][:2] == [False, True] and plan.chosen.tp_size == 2
    tp2 = plan.chosen
    assert tp2.weight_bytes < plan.weight_bytes["bfloat16"] // 2 + 2 * 4096 * 33  # + norms
    assert tp2.kv.bytes_per_block == 16 * 2 * 32 * 4 * 128 * 2  # 4 KV heads a rank
    budget = int(16 * GIB * 0.9) - 512 * MIB - tp2.weight_bytes
    assert tp2.kv.budget == budget - tp2.activation_bytes - tp2.graph_pool_bytes
    assert tp2.kv.num_blocks == tp2.kv.budget // tp2.kv.bytes_per_block


def test_gemma3_sliding_windows(tmp_path):
    path = write_config(tmp_path, GEMMA3_270M)
    plan = plan_memory(path, H100, PlanSettings())
    h, layers, vocab = 640, 18, 262144
    attn = 4 * 256 * h * 2 + 1 * 256 * h * 2  # q, o; k, v
    per_layer = attn + 3 * h * 2048 + 4 * h + 2 * 256  # four norms, q_norm and k_norm
    assert plan.parameters == vocab * h + layers * per_layer + h == 268_098_176  # tied
    per_token = 2 * layers * 1 * 256 * 2
    assert plan.kv_bytes_per_token["auto"] == per_token == 18432
    assert (plan.sliding_window, plan.sliding_layers) == (512, 15)
    # three global layers hold 32768 tokens, fifteen sliding ones 512
    per_layer_token = per_token // layers
    assert plan.kv_bytes_per_seq_windowed == (3 * 32768 + 15 * 512) * per_layer_token
    assert plan.chosen.tp_size == 1
    assert plan.chosen.max_concurrent_seqs == plan.chosen.kv.num_blocks // 2048 > 100
    # the tied token table is 63 % of the model: int4 keeps it 16-bit, int8 does not
    assert plan.token_table_parameters == vocab * h
    assert plan.weight_bytes["int4"] > plan.weight_bytes["int8"]
    groups = h // 128
    packed_table = vocab * h // 2 + vocab * groups * 2 + vocab * groups // 2
    assert plan.int4_packed_table_bytes == plan.weight_bytes["int4"] - 2 * vocab * h + packed_table


@pytest.mark.parametrize(
    "arch,quantization", [("llama", None), ("gemma3", "int8"), ("mixtral", "int8")]
)
def test_plan_matches_the_engine(tiny_model_dir, arch, quantization):
    """The engine on the CPU with a KV budget allocates the blocks the plan computes,
    and holds the weight bytes the plan computes."""
    model = tiny_model_dir(arch)
    budget = 3 * MIB
    llm = LLM(
        model,
        dtype="float32",
        kv_cache_memory_bytes=budget,
        max_model_len=256,
        quantization=quantization,
    )
    runner = llm.engine.runner
    settings = PlanSettings(
        dtype="float32",
        quantization=quantization,
        kv_cache_memory_bytes=budget,
        max_model_len=256,
        tensor_parallel_size=1,
    )
    plan = plan_memory(model, PlanDevice("cpu", 0, 0), settings)
    planned = plan.ranks[0]
    assert planned.kv.num_blocks == pytest.approx(runner.num_blocks, rel=0.05)
    assert planned.kv.cache_bytes == runner.kv_cache_bytes
    assert planned.weight_bytes == runner.weight_bytes


def test_cli_json_and_errors(tmp_path, capsys):
    path = write_config(tmp_path, MISTRAL_7B)
    args = ["plan", path, "--gpu-memory", "a100-40gb", "--max-model-len", "4096"]
    assert kvgate([*args, "--kv-cache-dtype", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chosen_tp_size"] == 1 and out["device"]["total_bytes"] == 40960 * MIB
    assert out["ranks"][0]["kv"]["bytes_per_block"] == 16 * 65536
    assert kvgate([*args, "--quantization", "int4"]) == 0
    text = capsys.readouterr().out
    assert "int4-g128" in text and "smallest tensor-parallel size that fits: 1" in text
    assert kvgate(["plan", path, "--gpu-memory", "80 parsecs"]) == 2
    assert "not a size" in capsys.readouterr().err
    assert kvgate(["plan", str(tmp_path / "missing"), "--gpu-memory", "l4"]) == 2
    # a device too small for any split is a plan that says so, and exit status 1
    assert kvgate(["plan", path, "--gpu-memory", "2GiB", "--max-model-len", "32768"]) == 1
    assert "no tensor-parallel size fits" in capsys.readouterr().out


def run_plan(*argv: str, cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`kvgate plan ARGV` in its own process, and the modules it imported (-X importtime
    lists each on stderr as it is imported)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gateway.cli", "plan", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    timings = [line for line in out.stderr.splitlines() if line.startswith("import time:")]
    out.stderr = "\n".join(line for line in out.stderr.splitlines() if line not in timings)
    return out, {line.rsplit("|", 1)[1].strip() for line in timings}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["broken.json"],
            "broken.json is not valid JSON: Expecting property name enclosed "
            "in double quotes at line 2, column 21",
        ),
        (["no_type.json"], "no_type.json: a config.json names its model_type"),
        (["missing.json"], "config file 'missing.json' does not exist"),
        (
            ["google/gemma-3-270m"],
            "'google/gemma-3-270m' is no file or directory here, and kvgate plan downloads nothing",
        ),
        (["empty_dir"], "empty_dir has no config.json"),
        (["fake.gguf"], "fake.gguf is not a GGUF file"),
        (["mistral.json", "--max-model-len", "0"], "max_model_len must be >= 1, got 0"),
        (["mistral.json", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must"),
        (["mistral.json", "--gpu-memory", "80 parsecs"], "not a size: '80 parsecs'"),
        (["mistral.json", "--kv-cache-memory", "lots"], "not a size: 'lots'"),
        (["mistral.json", "--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
    ],
)
def test_bad_input_is_refused_before_torch_is_imported(tmp_path, argv, message):
    (tmp_path / "mistral.json").write_text(json.dumps(MISTRAL_7B))
    (tmp_path / "broken.json").write_text('{"model_type": "llama",\n  "hidden_size": 64,,\n}')
    (tmp_path / "no_type.json").write_text('{"hidden_size": 64}')
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "fake.gguf").write_bytes(b"not a model")
    out, imported = run_plan(*argv, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("kvgate plan: ") and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert "torch" not in imported and "transformers" not in imported


def test_a_plan_explains_int4_larger_than_int8(tmp_path):
    """Gemma 3 270M's shape (the default model's): int4 above int8, and why."""
    (tmp_path / "gemma.json").write_text(json.dumps(GEMMA3_270M))
    out, imported = run_plan("gemma.json", "--gpu-memory", "l4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "torch" in imported  # the check above can see it
    weights = next(line for line in out.stdout.splitlines() if line.startswith("weights"))
    assert "int8 276.2 MiB, int4-g128 369.8 MiB" in weights
    note = " ".join(out.stdout.split())
    assert (
        "int4 is larger than int8 here: int4 packs the decoder layers and keeps the token "
        "table in bfloat16" in note
    )
    assert "167.8M of this model's 268.1M parameters (63%)" in note
    assert "A checkpoint with its table in int4 too takes 132.9 MiB." in note
    # a model whose table is a small part: int4 is the smallest, and nothing to explain
    (tmp_path / "mistral.json").write_text(json.dumps(MISTRAL_7B))
    out, _ = run_plan("mistral.json", "--gpu-memory", "h100-80gb", cwd=tmp_path)
    assert out.returncode == 0 and "int4 is larger" not in out.stdout
