"""DeepSeek: V3.1's and R1's special-token sections, V3.2's and V4's DSML."""

from __future__ import annotations

import re

from .base import CALL, CallGrammar, ToolFormat, section

# DeepSeek's markers are special tokens, spelled with a fullwidth bar and "▁".
_DEEPSEEK_CALL, DEEPSEEK_SEP, _DEEPSEEK_END = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)
_DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_V31 = ToolFormat(  # DeepSeek V3.1: a section of calls, each NAME<｜tool▁sep｜>{...}
    "deepseek-v3.1",
    markers=(_DEEPSEEK_SECTION[0], _DEEPSEEK_CALL),
    spec=section(
        r"\s*" + re.escape(_DEEPSEEK_CALL) + r"\s*(?P<name>[^\s<]+)\s*" + re.escape(DEEPSEEK_SEP),
        _DEEPSEEK_END,
        "json",
        CALL,
    ),
    grammar=CallGrammar(
        _DEEPSEEK_CALL,
        _DEEPSEEK_END,
        separator="",
        section_open=_DEEPSEEK_SECTION[0],
        section_close=_DEEPSEEK_SECTION[1],
        name_in_json=False,
        name_close=DEEPSEEK_SEP,
    ),
    ignore=_DEEPSEEK_SECTION,
)
DEEPSEEK_R1 = ToolFormat(  # R1 and its distills: function<｜tool▁sep｜>NAME, then fenced JSON
    "deepseek-r1",
    markers=(_DEEPSEEK_SECTION[0], _DEEPSEEK_CALL),
    spec=section(
        r"\s*"
        + re.escape(_DEEPSEEK_CALL)
        + r"\s*function\s*"
        + re.escape(DEEPSEEK_SEP)
        + r"\s*(?P<name>[^\s<`]+)\s*```json",
        "```" + _DEEPSEEK_END,
        "json",
        CALL,
    ),
    grammar=CallGrammar(
        _DEEPSEEK_CALL + "function" + DEEPSEEK_SEP,
        "\n```" + _DEEPSEEK_END,
        separator="\n",
        section_open=_DEEPSEEK_SECTION[0],
        section_close=_DEEPSEEK_SECTION[1],
        name_in_json=False,
        name_close="\n```json\n",
    ),
    ignore=_DEEPSEEK_SECTION,
)
_DSML = "｜DSML｜"  # DeepSeek V3.2 / V4's tag prefix, fullwidth bars


def _dsml(name: str, block: str) -> ToolFormat:
    """DeepSeek V3.2 (block "function_calls") and V4 ("tool_calls"): MiniMax's
    <invoke name=...> XML with DSML tags, each parameter saying whether its
    value is a string's text (string="true") or JSON. Values are read back
    cast by the tool's schema, as in the other XML formats."""
    d = re.escape(_DSML)
    return ToolFormat(
        name,
        markers=(f"<{_DSML}{block}>",),
        spec=section(
            rf'\s*(?:<{d}{block}>)?\s*<{d}invoke name="(?P<name>[^"\n]+)">',
            f"</{_DSML}invoke>",
            "xml-inline",
            CALL,
            content_args={
                "tag_pattern": (
                    rf'<{d}parameter name="(?P<key>[^"\n]+)" string="(?:true|false)">'
                    rf"(?P<value>.*?)</{d}parameter>"
                )
            },
        ),
        # As the template renders a call sent back, after an empty reply's "\n\n".
        grammar=CallGrammar(
            f'<{_DSML}invoke name="',
            f"</{_DSML}invoke>\n",
            separator="",
            section_open=f"\n\n<{_DSML}{block}>\n",
            section_close=f"</{_DSML}{block}>",
            name_in_json=False,
            name_close='">\n',
            xml=(f'<{_DSML}parameter name="', '" string="true">', f"</{_DSML}parameter>\n"),
            xml_json_key_close='" string="false">',
        ),
        ignore=(f"<{_DSML}{block}>", f"</{_DSML}{block}>"),
    )


DEEPSEEK_V32 = _dsml("deepseek-v3.2", "function_calls")
DEEPSEEK_V4 = _dsml("deepseek-v4", "tool_calls")
