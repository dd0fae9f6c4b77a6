"""MiniCPM5: <function name="NAME"><param name="KEY">VALUE</param></function>,
one call a line; a value holding "<", "&" or a newline in a CDATA block."""

from __future__ import annotations

from .base import CALL, CallGrammar, ToolFormat, section

MINICPM = ToolFormat(
    "minicpm",
    markers=('<function name="',),
    spec=section(
        r'\s*<function name="(?P<name>[^"\n]+)">',
        "</function>",
        "xml-inline",
        CALL,
        content_args={
            # transformers' tag patterns are the regex module's: a group name twice is fine.
            "tag_pattern": (
                r'<param name="(?P<key>[^"\n]+)">'
                r"(?:<!\[CDATA\[(?P<value>.*?)\]\]>|(?P<value>.*?))</param>"
            )
        },
    ),
    # As the template renders a call sent back: a value that is not a string
    # as Python writes it (True, False); a string as its text, where the
    # template would use CDATA only for "<", "&" or a newline.
    grammar=CallGrammar(
        '<function name="',
        "</function>",
        separator="\n",
        name_in_json=False,
        name_close='">',
        xml=('<param name="', '">', "</param>"),
        python_scalars=True,
    ),
)
