"""studies.spec_profile on the tiny Llama with a random EAGLE-3 head: every part of a
speculative step is timed on the speculating engine only, and the engine's methods
are themselves again afterwards (the times are the study's business, not a test's)."""

from __future__ import annotations

import json

from backend_gpu.engine import LLMEngine
from backend_gpu.model_runner import ModelRunner
from studies import spec_profile
from tests.backend_gpu.eagle3_heads import write_random_head
from tests.backend_gpu.tiny_models import save_tiny_model


def test_the_head_and_the_verify_are_timed_and_the_engine_restored(tmp_path):
    target = save_tiny_model("llama", str(tmp_path))
    head = write_random_head(target, str(tmp_path / "head"))
    step, prepare = LLMEngine.step, ModelRunner.prepare
    out = tmp_path / "profile.json"
    argv = ["--model", target, "--eagle3", head, "--prompts", "2", "--max-tokens", "6"]
    result = spec_profile.main([*argv, "--save-result", str(out)])
    plain, eagle = result["plain"]["ms_per_step"], result["eagle3"]["ms_per_step"]
    for part in ("head: step rows", "head: layer", "head: draw", "propose"):
        assert plain[part] == 0 and eagle[part] > 0
    for part in ("target: model", "target: LM head", "sample / verify", "engine step"):
        assert plain[part] > 0 and eagle[part] > 0
    for r in result.values():  # this thread's CPU time: within the wall time it took
        assert 0 < r["cpu_ms_per_step"]["engine step"] <= r["ms_per_step"]["engine step"] + 0.01
    assert result["plain"]["acceptance_length"] is None
    assert 1 <= result["eagle3"]["acceptance_length"] <= 4
    assert LLMEngine.step is step and ModelRunner.prepare is prepare
    assert json.loads(out.read_text())["engines"]["eagle3"]["steps"] > 0
