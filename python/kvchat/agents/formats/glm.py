"""GLM's keys and values: NAME<arg_key>k</arg_key><arg_value>v</arg_value>
(GLM-4.5 on, and Hy3's with its :opensource tags)."""

from __future__ import annotations

from .base import CALL, CallGrammar, ToolFormat, section

GLM = ToolFormat(  # GLM-4.5/4.6: <tool_call>NAME <arg_key>k</arg_key><arg_value>v</arg_value>
    "glm",
    markers=("<tool_call>",),
    spec=section(
        r"\s*<tool_call>(?P<name>[^\n<]+?)\s*(?=<arg_key>|</tool_call>)",
        "</tool_call>",
        "xml-inline",
        CALL,
        content_args={
            "tag_pattern": (
                r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>"
            )
        },
    ),
    grammar=CallGrammar(
        "<tool_call>",
        "</tool_call>",
        name_in_json=False,
        name_close="\n",
        xml=("<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n"),
    ),
)
_HY = ":opensource"  # Hy3's tags carry it: <tool_call:opensource>
HY3 = ToolFormat(  # Hy3: GLM's keys and values, a section, NAME<tool_sep:opensource>
    "hy3",
    markers=(f"<tool_calls{_HY}>", f"<tool_call{_HY}>"),
    spec=section(
        rf"\s*<tool_call{_HY}>(?P<name>[^\n<]+?)<tool_sep{_HY}>",
        f"</tool_call{_HY}>",
        "xml-inline",
        CALL,
        content_args={
            "tag_pattern": (
                rf"<arg_key{_HY}>(?P<key>.*?)</arg_key{_HY}>\s*"
                rf"<arg_value{_HY}>(?P<value>.*?)</arg_value{_HY}>"
            )
        },
    ),
    grammar=CallGrammar(
        f"<tool_call{_HY}>",
        f"</tool_call{_HY}>\n",
        separator="",
        section_open=f"<tool_calls{_HY}>\n",
        section_close=f"</tool_calls{_HY}>",
        name_in_json=False,
        name_close=f"<tool_sep{_HY}>\n",
        xml=(f"<arg_key{_HY}>", f"</arg_key{_HY}>\n<arg_value{_HY}>", f"</arg_value{_HY}>\n"),
    ),
    ignore=(f"<tool_calls{_HY}>", f"</tool_calls{_HY}>"),
)
