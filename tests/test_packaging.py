"""The wheel ships the product only: setuptools' package discovery, with pyproject's own
include list, finds `bench` (`kvgate bench`) but neither the studies nor the dev tools,
which import what they like and are run from a checkout."""

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_no_study_and_no_tool():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(ROOT), include=include)
    assert "bench" in packages and "gateway" in packages
    roots = {name.split(".")[0] for name in packages}
    assert not roots & {"studies", "tools", "tests"}, sorted(roots)
