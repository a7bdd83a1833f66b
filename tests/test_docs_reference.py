"""The docs' reference parts made from the code (tools/reference_*.py, run by the MkDocs
hook at every `make docs`): they cover every setting, command and route, and a setting
nobody described fails the build instead of going missing."""

from __future__ import annotations

import dataclasses
import re

import pytest

from gateway.config import Settings
from gateway.config_load import _ENV_FIELDS
from gateway.routes.openapi import build_document
from tools import reference_config
from tools.reference_cli import cli_reference, command_paths
from tools.reference_http import http_reference


def test_the_settings_table_has_every_setting_and_variable() -> None:
    table = reference_config.settings_table()
    rows = re.findall(r"^\| `(\w+)` \| (`KVGATE_\w+`)?", table, re.MULTILINE)
    documented = {name for name, _ in rows}
    settings = {f.name for f in dataclasses.fields(Settings)} - reference_config.TABLES
    assert documented == settings
    variables = {var.strip("`") for _, var in rows if var}
    assert variables == {f"KVGATE_{name.upper()}" for name in _ENV_FIELDS}
    # a flag's help says what its setting does: the table quotes it
    assert "| `--max-num-seqs` |" in table and "sequences scheduled together" in table


def test_a_setting_nobody_described_fails_the_build(monkeypatch) -> None:
    described = dict(reference_config.FLAGLESS)
    del described["instance"]
    monkeypatch.setattr(reference_config, "FLAGLESS", described)
    with pytest.raises(RuntimeError, match="'instance' has no flag and no description"):
        reference_config.settings_table()


def test_the_cli_reference_has_every_command_as_it_prints_its_help() -> None:
    text = cli_reference()
    paths = list(command_paths())
    assert ("tenants", "create") in paths and ("bench", "serve") in paths and ("top",) in paths
    for path in paths:
        assert f"kvgate {' '.join(path)}\n" in text, path
        assert f"usage: kvgate {' '.join(path)}" in text, path


def test_the_http_reference_has_every_route_and_schema() -> None:
    document = build_document()
    text = http_reference()
    for path, item in document["paths"].items():
        for method in item:
            assert f"### `{method.upper()} {path}`" in text, (method, path)
    for name in document["components"]["schemas"]:
        assert f"\n### {name}\n" in text, name
