"""Each model family's reasoning and tool-call text read out of its output (issue 48), by
vLLM's parser names. Pure text: this room imports no other room of the gateway.

`output_parser(reasoning, tools, ...)` makes one parser per choice (`feed` any split of the
text, `finish` at the end; `feed_final` for a whole answer's text: both in one pass);
`detect` chooses the names from a model's chat template.
"""

from gateway.parsers.base import OutputParser, ParsedDelta, ToolCallDelta, merge_calls, parse_whole
from gateway.parsers.detect import detect
from gateway.parsers.registry import REASONING_PARSERS, TOOL_PARSERS, output_parser

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "OutputParser",
    "ParsedDelta",
    "ToolCallDelta",
    "detect",
    "merge_calls",
    "output_parser",
    "parse_whole",
]
