"""Rewrite the test modules' asserts once, before `make test`'s xdist workers start.

pytest rewrites every test module's asserts when it imports it and caches the result in
`__pycache__`, but not where PYTHONDONTWRITEBYTECODE is set (as on the CI machine): each of
the four workers, which all collect the whole suite, then rewrote all 245 modules again,
about 10 of a worker's 25 CPU-s of collection (docs/PERF.md, issue 46.9). This writes the
cache pytest reads either way, once: `python -m tools.warm_asserts [ROOT]`.

It uses pytest's own rewriting (`_pytest.assertion.rewrite`, not a public API), so where a
pytest release changes it, this says so and does nothing: the suite then pays the
rewrites, as before, and its results do not change. A module is rewritten only where no
cache entry matches its source (pytest checks the source's size and mtime on reading).
"""

from __future__ import annotations

import fnmatch
import os
import sys
from pathlib import Path

# pytest's defaults, which pyproject.toml keeps (python_files), and the conftests
PATTERNS = ("test_*.py", "*_test.py", "conftest.py")


def warm(root: Path) -> int:
    """Rewritten modules written; raises where pytest's internals are not as expected."""
    from _pytest.assertion import rewrite

    written = 0
    for fn in sorted(root.rglob("*.py")):
        if not any(fnmatch.fnmatch(fn.name, p) for p in PATTERNS):
            continue
        cache_dir = rewrite.get_cache_dir(fn)
        pyc = cache_dir / (fn.name[:-3] + rewrite.PYC_TAIL)
        if rewrite._read_pyc(fn, pyc) is not None:
            continue
        source_stat, co = rewrite._rewrite_test(fn, None)  # None: pytest's default settings
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = pyc.with_name(f"{pyc.name}.{os.getpid()}")
        with open(partial, "wb") as fp:
            rewrite._write_pyc_fp(fp, source_stat, co)
        os.replace(partial, pyc)  # atomic, as pytest's own writes: a worker reads whole files
        written += 1
    return written


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "tests")
    try:
        written = warm(root)
    except Exception as exc:  # a changed private API: the suite rewrites, as it did before
        print(f"warm_asserts: skipped ({type(exc).__name__}: {exc})")
        return 0
    print(f"warm_asserts: {written} test modules rewritten once for the workers")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
