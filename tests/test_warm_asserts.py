"""tools/warm_asserts.py writes the rewritten test modules pytest itself reads: a module
it warmed loads from the cache with its asserts rewritten, and a changed source is
rewritten again rather than served stale."""

from __future__ import annotations

import os
from pathlib import Path

from _pytest.assertion import rewrite

from tools.warm_asserts import warm


def _cached(fn: Path):
    pyc = rewrite.get_cache_dir(fn) / (fn.name[:-3] + rewrite.PYC_TAIL)
    return rewrite._read_pyc(fn, pyc)


def test_a_warmed_module_is_read_from_the_cache_with_its_asserts_rewritten(tmp_path: Path) -> None:
    module = tmp_path / "test_sample.py"
    module.write_text("def test_it():\n    a = [1, 2]\n    assert a == [1, 3]\n")
    (tmp_path / "helper.py").write_text("x = 1\n")  # not a test module: left alone

    assert warm(tmp_path) == 1
    code = _cached(module)
    assert code is not None
    # rewritten: the assert's operands are kept for the report (pytest's @py_assert names)
    names = {n for c in code.co_consts if hasattr(c, "co_varnames") for n in c.co_varnames}
    assert any(n.startswith("@py_assert") for n in names)
    assert warm(tmp_path) == 0  # up to date: nothing rewritten twice

    module.write_text("def test_it():\n    assert 1 + 1 == 2\n\n\n")
    stat = module.stat()
    os.utime(module, (stat.st_atime, stat.st_mtime + 5))
    assert _cached(module) is None  # pytest would not use the stale entry
    assert warm(tmp_path) == 1
    assert _cached(module) is not None
