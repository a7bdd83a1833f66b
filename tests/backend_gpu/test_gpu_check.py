"""studies/gpu_check: what of it a CPU can run. The bandwidth arithmetic, the options,
the script's paths, and the whole kvgate half on a tiny shape (the GPU runs the real
one, studies/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from studies import batch_yield, gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_bandwidth_share_of_a_batch1_decode():
    # Llama 3 8B in bfloat16: 16.06 GB of weights, 1.05 GB of them the input table (a
    # lookup), 128 KiB of KV per position (32 layers x 8 heads x 128 x 2 bytes, K and V)
    per_token = gpu_check.decode_bytes_per_token(16_060_000_000, 1_050_000_000, 131072, 200.0)
    assert per_token == 16_060_000_000 - 1_050_000_000 + 131072 * 200
    share = gpu_check.bandwidth_share(250.0, per_token, gpu_check.H200_BANDWIDTH)
    assert share == pytest.approx(250 * 15_036_214_400 / 4.8e12)
    assert 0.78 < share < 0.79


def test_options_and_their_checks():
    args = gpu_check.parse_args(["--out", "x"])
    assert (args.shape, args.device, args.budget_s) == ("llama3-8b", "cuda", 250.0)
    assert args.only == gpu_check.PARTS and args.vocab == 128256
    assert gpu_check.parse_args(["--out", "x", "--prompt-lens", "3,9"]).prompt_lens == (3, 9)
    for bad in ("9,3", "0,4", "7"):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--out", "x", "--output-lens", bad])
    assert gpu_check.ratios({"kvgate_bf16": {"tokens_per_s": 300.0}, "transformers_cb": {}}) == {}
    parts = {"kvgate_bf16": {"tokens_per_s": 300.0}, "kvgate_fp8": {"tokens_per_s": 450.0}}
    parts["transformers_cb"] = {"tokens_per_s": 100.0}
    assert gpu_check.ratios(parts) == {
        "kvgate_bf16_over_transformers_cb": 3.0,
        "kvgate_fp8_over_bf16": 1.5,
    }


def test_the_script_runs_files_that_exist():
    script = (ROOT / "studies/gpu_check.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "studies/gpu_check.sh")], check=True)
    files = re.findall(r"tests/backend_gpu/\w+\.py", script)
    assert "tests/backend_gpu/test_cuda.py" in files
    assert all((ROOT / f).is_file() for f in files)
    assert "-m studies.gpu_check" in script and "-m cuda" in script
    steps = re.findall(r"^step (\w+) .* -m studies\.(\w+)", script, re.M)
    assert steps and all((ROOT / f"studies/{module}.py").is_file() for _, module in steps)


def test_steps_picks_the_parts_to_run(tmp_path):
    """STEPS splits the check over commands: only the named steps run (python is `echo`
    here, so each step's log holds the command it would have run)."""
    env = dict(os.environ, STEPS="lora_kernels", PYTHON="echo")
    script = ROOT / "studies/gpu_check.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path)], env=env, cwd=ROOT)
    assert done.returncode == 0
    logs = sorted(p.name for p in tmp_path.glob("*.log"))
    assert logs == ["lora_kernels.log"]
    assert "-m studies.lora_kernels --out" in (tmp_path / "lora_kernels.log").read_text()


def test_batch_yield_step_asks_for_the_engine_on_cuda(tmp_path):
    """Issue 50's step: its command line is one the study takes, and puts the gpu engine
    on CUDA in bfloat16 with two slots and a 4 GiB KV cache (the model itself is built
    here smaller than the step's hidden 2048, to stay quick)."""
    env = dict(os.environ, STEPS="batch_yield", PYTHON="echo")
    subprocess.run(["bash", str(ROOT / "studies/gpu_check.sh"), str(tmp_path)], env=env, check=True)
    argv = shlex.split((tmp_path / "batch_yield.log").read_text().splitlines()[0])
    assert argv[:2] == ["-m", "studies.batch_yield"]
    args = batch_yield.parse_args(argv[2:])
    assert (args.backend, args.hidden, args.layers) == ("gpu", 2048, 8)
    args.hidden, args.layers, args.heads, args.vocab = 64, 2, 4, 300
    entry = tomllib.loads(batch_yield.gpu_backend(args, tmp_path))["backends"][0]
    assert entry["type"] == "gpu"
    assert entry["options"] == {
        "max_num_seqs": 2, "device": "cuda", "dtype": "bfloat16",
        "kv_cache_memory_bytes": 4096 << 20,
    }  # fmt: skip
    model = json.loads((Path(entry["model"]) / "config.json").read_text())
    assert (model["hidden_size"], model["num_hidden_layers"], model["vocab_size"]) == (64, 2, 300)
    assert model["num_key_value_heads"] == 2


def test_transformers_on_a_cpu_gets_a_cache_the_size_of_the_requests():
    """Not 90% of the host's memory, as transformers sizes it from a GPU's."""
    config = gpu_check.cpu_batching_config([([5] * 40, 6), ([5] * 3, 2), ([5] * 300, 8)])
    assert (config.num_blocks, config.max_batch_tokens) == (3 * 2, 343)  # pages of 256


@pytest.mark.timeout(600)
def test_every_part_runs_on_a_tiny_shape(tmp_path):
    """kvgate in both precisions and transformers' continuous batching on the same
    requests (transformers' API checked here, 5.24, and by hand with 5.17, the H200's).
    A budget no part should reach (none may be cut), even beside `make test`'s other
    workers on two cores."""
    argv = ["--out", str(tmp_path), "--shape", "tiny", "--device", "cpu", "--num-requests", "5"]
    argv += ["--only", "kvgate_bf16", "kvgate_fp8", "transformers_cb"]
    argv += ["--prompt-lens", "3,40", "--output-lens", "2,6"]
    argv += ["--batch1-prompt", "8", "--batch1-tokens", "6", "--budget-s", "480"]
    gpu_check.main(argv)
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    bf16, fp8 = results["parts"]["kvgate_bf16"], results["parts"]["kvgate_fp8"]
    for part in (bf16, fp8):
        assert "error" not in part and not part["cut"] and part["requests"] == 5
        assert part["tokens_per_s"] > 0 and part["graph_steps"] == 0  # no graphs on a CPU
        b1 = part["batch1"]
        assert b1["decode_tokens"] == 5 and b1["mean_context"] == 8 + 3
        assert b1["bandwidth_share"] == pytest.approx(
            b1["tokens_per_s"] * b1["bytes_per_token"] / gpu_check.H200_BANDWIDTH
        )
    # 8-bit weights: fewer bytes per decoded token
    assert fp8["weight_bytes"] < 0.5 * bf16["weight_bytes"]
    assert fp8["batch1"]["bytes_per_token"] < bf16["batch1"]["bytes_per_token"]
    peer = results["parts"]["transformers_cb"]
    assert "error" not in peer and not peer["cut"] and peer["requests"] == 5
    assert peer["output_tokens"] == bf16["output_tokens"] == fp8["output_tokens"]
    assert set(results["ratios"]) == {"kvgate_fp8_over_bf16", "kvgate_bf16_over_transformers_cb"}
    assert results["env"]["device"] == "cpu"
