"""`make install` hands uv the sources pip is configured with (tools/pip_sources.py)."""

from __future__ import annotations

import shlex
import subprocess
import sys

from tools.pip_sources import effective, uv_arguments

LISTING = """\
:env:.find-links='/env/wheels'
global.find-links='/global/wheels'
global.extra-index-url='file:///nowhere/simple https://mirror.example/simple'
global.constraint='/etc/pip/c.txt'
install.index-url='https://install.example/simple'
global.index-url='https://global.example/simple'
global.cert='/etc/ssl/ca.crt'
user.timeout='3'
"""


def test_the_highest_scope_wins_and_every_item_is_a_flag():
    settings = effective(LISTING)
    assert settings["find-links"] == "/env/wheels"  # the environment over the files
    assert settings["index-url"] == "https://install.example/simple"  # install over global
    assert uv_arguments(settings) == [
        "--find-links",
        "/env/wheels",
        "--default-index",
        "https://install.example/simple",
        # the file:// index that does not exist is left out, as pip leaves it out
        "--extra-index-url",
        "https://mirror.example/simple",
        "--constraints",
        "/etc/pip/c.txt",
        "--system-certs",
    ]


def test_no_configuration_is_no_arguments():
    assert uv_arguments(effective("")) == []
    assert uv_arguments(effective("global.no-index='true'")) == ["--no-index"]


def test_the_printed_line_reads_back_as_the_arguments(tmp_path):
    env = {"PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": str(tmp_path / "it's")}
    out = subprocess.run(
        [sys.executable, "-m", "tools.pip_sources"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    assert shlex.split(out) == ["--find-links", str(tmp_path / "it's")]
