"""The package sources pip is configured with, as arguments for `uv pip install`.

`make install` installs with uv, which unpacks and byte-compiles on every core from a
cache of its own: a fresh `.venv` in well under a minute where pip took about three
(docs/PERF.md, issue 46.9). uv does not read pip's configuration, and a machine's may be
what makes an install work at all: a local wheel directory holding the CPU build of
torch, a mirror, a constraints file. This prints, shell-quoted for `eval "set -- ..."`,
the uv flags that say the same as pip's effective `find-links`, `index-url`,
`extra-index-url`, `constraint`, `no-index` and `cert` (environment over the `install`
section over `global`, as pip takes them). A `file://` index that does not exist is left
out, as pip leaves it out with a warning.

    python -m tools.pip_sources          # e.g. --find-links /opt/wheels --extra-index-url ...
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

# pip's key -> uv's flag; a value of several whitespace-separated items gives one flag each
FLAGS = {
    "find-links": "--find-links",
    "index-url": "--default-index",
    "extra-index-url": "--extra-index-url",
    "constraint": "--constraints",
}
SCOPES = ("global", "install", ":env:")  # lowest precedence first


def effective(listing: str) -> dict[str, str]:
    """pip's settings from `pip config list` lines (`scope.key='value'`), the highest
    precedence scope's value for each key."""
    found: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        scope, dot, key = name.rpartition(".")
        if not (sep and dot) or scope not in SCOPES:
            continue
        found.setdefault(key, {})[scope] = " ".join(shlex.split(value))
    return {key: next(v[s] for s in reversed(SCOPES) if s in v) for key, v in found.items()}


def _usable(location: str) -> bool:
    url = urlparse(location)
    return url.scheme != "file" or Path(url.path).exists()


def uv_arguments(settings: dict[str, str]) -> list[str]:
    args: list[str] = []
    for key, flag in FLAGS.items():
        for item in settings.get(key, "").split():
            if _usable(item):
                args += [flag, item]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if settings.get("cert"):
        args.append("--system-certs")  # the system's store, where a configured cert lives
    return args


def main() -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    print(shlex.join(uv_arguments(effective(listing))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
