"""A JSON list of calls between two tags (Apriel, Nemotron Nano v2, Apertus)."""

from __future__ import annotations

import re

from .base import CALL, EACH, CallGrammar, ToolFormat, section


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
# Apertus: <|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>, each call an
# object whose one key is the function's name. A call's region is its
# arguments: from after the key to the "}" that the next call's "{" or the
# list's end follows, which opens the next call's region too. (A list of
# objects inside the arguments holds "}, {" as well: such a section does not
# parse, and stays text.)
_APERTUS = ("<|tools_prefix|>", "<|tools_suffix|>")
APERTUS = ToolFormat(
    "apertus",
    markers=(_APERTUS[0],),
    spec=section(
        r'\s*(?:<\|tools_prefix\|>\[\s*\{)?\s*"(?P<name>[^"\n]+)"\s*:\s*',
        ["}, {", "},{", "}]" + _APERTUS[1]],
        "json",
        CALL,
    ),
    # Not constrained: the parser splits calls at "}, {", which arguments
    # holding a list of objects (or a string with it) hold too, so a forced
    # call could come back as text. A forced call is refused by name.
    grammar=None,
)
