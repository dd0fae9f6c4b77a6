"""A JSON list of calls between two tags (Apriel, Nemotron Nano v2)."""

from __future__ import annotations

import re

from .base import EACH, CallGrammar, ToolFormat, section


def _json_list(name: str, open_tag: str, close_tag: str) -> ToolFormat:
    """OPEN[{"name": ..., "arguments": ...}, ...]CLOSE: a JSON list of calls."""
    return ToolFormat(
        name,
        markers=(open_tag,),
        spec=section(r"\s*" + re.escape(open_tag), close_tag, "json", EACH, transform_each=True),
        grammar=CallGrammar(
            "", separator=", ", section_open=open_tag + "[", section_close="]" + close_tag
        ),
    )


APRIEL = _json_list("apriel", "<tool_calls>", "</tool_calls>")  # Apriel 1.5
NEMOTRON_V2 = _json_list("nemotron-v2", "<TOOLCALL>", "</TOOLCALL>")  # Nemotron Nano v2
