"""Replies with nothing to say, on the real path (issue 45): a tiny model that often stops
at once or emits only special tokens, served by a real `kvgate serve`; `kvgate bench serve`
counts those replies as completed with the server's token counts, on both APIs it drives,
and `kvgate tune` on that model chooses a config rather than stopping every candidate."""

import json

import pytest

from bench.cli import main as bench
from bench.history import load_records
from gateway.cli.main import main as kvgate
from tests.bench.silent_model import build_silent_llama
from tests.conftest import start_gateway

# bench's random prompts, 20 of 8 words (seed 0): several of them get no text back
WORKLOAD = ["--num-prompts", "20", "--input-len", "8", "--output-len", "6"]


@pytest.fixture(scope="module")
def silent_model(tmp_path_factory):
    return build_silent_llama(tmp_path_factory.mktemp("silent") / "model")


def test_bench_counts_replies_without_text(silent_model, tmp_path):
    config = f'[[backends]]\nname = "silent"\ntype = "gpu"\nmodel = "{silent_model}"\n'
    config += 'device = "cpu"\nmax_model_len = 256\n'
    gw = start_gateway(tmp_path, config=config, timeout=300)
    try:
        key = gw.tenant_key("silent")[1]
        for endpoint in ("completions", "chat"):
            out = tmp_path / f"{endpoint}.json"
            argv = ["serve", "--url", gw.url, "--api-key", key, "--endpoint", endpoint]
            argv += [*WORKLOAD, "--no-progress", "--save-result", str(out), "--save-detailed"]
            assert bench(argv) == 0, endpoint
            result = json.loads(out.read_text())
            assert result["completed"] == 20 and result["failed"] == 0, result["errors"]
            assert not any(result["errors"])
            # the replies that stopped at once: one token by the server's usage, no gap
            stopped = [i for i, n in enumerate(result["output_lens"]) if n == 1]
            assert stopped and all(result["itls"][i] == [] for i in stopped), endpoint
            assert result["total_output_tokens"] == sum(result["output_lens"])
            assert result["missing_usage"] == 0
    finally:
        gw.stop()


def test_tune_chooses_a_config_for_a_model_that_says_nothing(silent_model, tmp_path, capsys):
    out, history = tmp_path / "tune", tmp_path / "history"
    argv = ["tune", "--backend", "gpu", "--model", str(silent_model), "--device", "cpu"]
    argv += ["--max-model-len", "256", "--slo-ttft-p99", "60", "--slo-tpot-p99", "10"]
    argv += ["--budget", "1s", "--output", str(out), *WORKLOAD]
    argv += ["--results-dir", str(history), "--no-progress"]
    assert kvgate(argv) == 0, capsys.readouterr().err
    (row,) = json.loads((out / "tune.json").read_text())["candidates"]
    assert row["meets_goals"] and row["chosen"]
    assert (out / "kvgate.toml").read_text().count("[[backends]]") == 1
    (record,) = load_records(history)
    assert record["figures"]["completed"] == 20 and record["figures"]["failed"] == 0
