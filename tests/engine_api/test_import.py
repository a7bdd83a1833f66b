"""engine_api is the contract every side imports: it must load without any engine's heavy
dependencies, and every side must hold the very same classes."""

from __future__ import annotations

import json
import subprocess
import sys

import engine_api
from backend_gpu import SamplingParams as GpuSamplingParams
from backend_local import EngineDeadError as LocalEngineDeadError
from backend_local import PromptTooLongError as LocalPromptTooLongError
from backend_local import SamplingParams as LocalSamplingParams
from gateway import backends

BLOCKED = ("torch", "numpy", "llama_cpp", "aiohttp")

# Imports every engine_api module with the heavy packages made unimportable, then checks
# that no gateway or backend module came along.
IMPORT_ALL = f"""
import importlib, json, pkgutil, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked in this test")

sys.meta_path.insert(0, Blocked())
import engine_api
names = [m.name for m in pkgutil.iter_modules(engine_api.__path__)]
for name in names:
    importlib.import_module("engine_api." + name)
leaked = [m for m in sys.modules if m.partition(".")[0] in ("gateway", "backend_gpu", "backend_local")]
assert not leaked, leaked
print(json.dumps(names))
"""


def test_imports_without_torch_numpy_llama_cpp_or_aiohttp():
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    # the blocker really ran over the shared helpers, not over an empty package
    assert {"block_hash", "errors", "records", "sampling", "throughput", "wire"} <= set(
        json.loads(done.stdout)
    )


def test_the_blocker_catches_a_heavy_import():
    code = IMPORT_ALL.replace("import engine_api\n", "import engine_api\nimport numpy\n", 1)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "numpy is blocked" in done.stderr


def test_gateway_and_both_backends_share_one_definition():
    assert GpuSamplingParams is LocalSamplingParams is backends.SamplingParams
    assert GpuSamplingParams is engine_api.SamplingParams
    assert LocalPromptTooLongError is backends.PromptTooLongError is engine_api.PromptTooLongError
    assert LocalEngineDeadError is engine_api.EngineDeadError
    assert backends.GenRequest is engine_api.GenRequest
    assert backends.BackendError is engine_api.BackendError
