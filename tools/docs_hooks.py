"""The docs site's MkDocs hook (mkdocs.yml: hooks): the reference pages' generated parts,
made from the code at every build (`make docs`), so they cannot drift from it. A page
holds `<!-- generated: NAME -->` on a line of its own where the part goes; the OpenAPI
document is published beside the HTTP reference as reference/openapi.json.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tools`: not installed

from tools.reference_cli import cli_reference  # noqa: E402
from tools.reference_config import settings_table  # noqa: E402
from tools.reference_http import http_reference, openapi_json  # noqa: E402

MARKER = re.compile(r"^<!-- generated: (?P<name>[\w-]+) -->$", re.MULTILINE)
GENERATORS = {"cli": cli_reference, "settings": settings_table, "http": http_reference}


def on_files(files: Files, config: Any, **_: Any) -> Files:
    files.append(File.generated(config, "reference/openapi.json", content=openapi_json()))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    def fill(found: re.Match[str]) -> str:
        generate = GENERATORS.get(found["name"])
        if generate is None:
            raise PluginError(f"{page.file.src_path}: no generated part {found['name']!r}")
        return generate()

    return MARKER.sub(fill, markdown)
