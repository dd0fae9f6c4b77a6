"""Qwen's XML parameters: <function=NAME><parameter=KEY>VALUE</parameter> (Qwen3.5,
Qwen3-Coder, and Seed-OSS's in <seed:tool_call>)."""

from __future__ import annotations

from .base import CALL, CallGrammar, ToolFormat, section

QWEN_XML = ToolFormat(  # Qwen3.5, Qwen3-Coder: XML parameters inside <tool_call>
    "qwen-xml",
    markers=("<tool_call>",),
    spec=section(
        r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
        "</tool_call>",  # the </function> before it is outside every parameter
        "xml-inline",
        CALL,
        content_args={
            "tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>"
        },
    ),
    grammar=CallGrammar(
        "<tool_call>\n<function=",
        "</function>\n</tool_call>",
        name_in_json=False,
        name_close=">\n",
        xml=("<parameter=", ">\n", "\n</parameter>\n"),
        python_scalars=True,
    ),
)

SEED_OSS = ToolFormat(  # Seed-OSS: Qwen's XML parameters in <seed:tool_call>, no newlines
    "seed-oss",
    markers=("<seed:tool_call>",),
    spec=section(
        r"\s*<seed:tool_call>\s*<function=(?P<name>[^>\n]+)>",
        "</seed:tool_call>",
        "xml-inline",
        CALL,
        content_args={"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)</parameter>"},
    ),
    grammar=CallGrammar(
        "<seed:tool_call>\n<function=",
        "</function>\n</seed:tool_call>",
        name_in_json=False,
        name_close=">\n",
        xml=("<parameter=", ">", "</parameter>\n"),
        python_scalars=True,  # the template writes a value that is not a string |string
    ),
)
