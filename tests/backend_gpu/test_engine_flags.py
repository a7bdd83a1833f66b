"""`--device` and `--dtype` of `kvgate serve` and `kvgate worker` reach the engine."""

from __future__ import annotations

import pytest
import torch

from engine_api.records import GenRequest
from engine_api.sampling import SamplingParams
from gateway.backends import build_backend
from gateway.cli import build_parser
from gateway.cli import main as kvgate_main
from gateway.config_load import load_settings
from gateway.worker import cli as worker_cli


def settings_for(*argv: str):
    args = build_parser().parse_args(list(argv))
    return load_settings(None, worker_cli.engine_overrides(args), environ={})


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_device_and_dtype_become_engine_options(command):
    (spec,) = settings_for(
        command, "--backend", "gpu", "--device", "cpu", "--dtype", "bfloat16"
    ).resolved_backends()
    assert spec.type == "gpu" and spec.options == {"device": "cpu", "dtype": "bfloat16"}
    (spec,) = settings_for(command, "--backend", "gpu").resolved_backends()
    assert "device" not in spec.options and "dtype" not in spec.options  # the engine's auto


def test_other_backends_refuse_them(capsys, tmp_path):
    with pytest.raises(ValueError, match=r"\['device', 'dtype'\] need the gpu backend"):
        settings = settings_for(
            "serve", "--backend", "local", "--device", "cpu", "--dtype", "float32"
        )
        settings.resolved_backends()
    db = f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    status = kvgate_main(["serve", "--backend", "fake", "--dtype", "float32", "--database-url", db])
    assert status == 2 and "['dtype'] need the gpu backend" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--device", "tpu"])


async def test_the_engine_runs_where_the_flags_say(tiny_model_dir):
    (spec,) = settings_for(
        "serve",
        "--backend",
        "gpu",
        "--model",
        tiny_model_dir("llama"),
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
    ).resolved_backends()
    backend = build_backend(spec)
    await backend.start()
    try:
        engine = backend.engine.engine
        assert (engine.config.device, engine.config.dtype) == ("cpu", "bfloat16")
        runner = engine.runner
        assert runner.device == torch.device("cpu")
        assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
        assert runner.attention_layers[0].k_cache.dtype == torch.bfloat16
        request = GenRequest(
            request_id="r",
            model=backend.model_id,
            prompt_token_ids=[5, 6, 7],
            sampling=SamplingParams(max_tokens=3, ignore_eos=True),
        )
        chunks = [chunk async for chunk in backend.generate(request)]
        assert sum(len(c.token_ids) for c in chunks) == 3
    finally:
        await backend.stop(drain=False)
