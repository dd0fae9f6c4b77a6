"""Tool-call formats: how a chat template's model writes a tool call.

A format is chosen from the chat template's text (the markup it renders an
assistant's ``tool_calls`` with), never from a model's name. Each one is a
transformers ``response_template`` (transformers' own declarative response
parsing, ``transformers.utils.chat_parsing``) for the tool-call section, the
literal markers that open that section, and how a constrained turn writes one
call (``grammar.py``). A tokenizer that carries its own ``response_template``
is parsed with that instead.
"""

from __future__ import annotations

import re
import secrets
import string
from dataclasses import dataclass

# transformers' transform template: every parsed call becomes OpenAI's shape.
_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}
# transform_each: each element of a parsed list of calls.
_EACH = {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}
_CALL_FROM_JSON = {"type": "function", "function": "{content}"}


@dataclass(frozen=True)
class CallGrammar:
    """How a constrained turn writes calls (``grammar.py``): ``section_open``,
    the calls (joined by ``separator``; None: one call only),
    ``section_close``. A call is ``call_open``, then either one JSON object
    ``{name_key: NAME, arguments_key: ARGUMENTS}`` (``name_in_json``) or NAME,
    ``name_close`` and the arguments, then ``call_close``. The arguments are
    one JSON object, or with ``xml`` (key_open, key_close, value_close) one
    tagged parameter each: key_open KEY key_close VALUE value_close, a string
    written as its text and any other value as JSON; or with
    ``keyword_arguments``, ``key=VALUE`` joined by ", " (LFM2's Python
    calls), a value written as the template writes it where the parser
    reads that back (a plain string in single quotes, True, False, None)
    and as JSON otherwise, which the parser also reads."""

    call_open: str
    call_close: str = ""
    separator: str | None = "\n"
    section_open: str = ""
    section_close: str = ""
    name_in_json: bool = True
    name_key: str = "name"
    name_close: str = ""
    arguments_key: str = "arguments"
    xml: tuple[str, str, str] | None = None
    # DeepSeek's DSML says in each tag whether its value is a string's text:
    # key_close for a value written as JSON (xml[1] is a text value's).
    xml_json_key_close: str | None = None
    keyword_arguments: bool = False
    # Booleans as the template writes them: Qwen's XML templates apply |string
    # to a scalar (True, False), GLM's tojson (true, false).
    python_scalars: bool = False


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call markup.

    ``markers``: literal texts that open the tool-call section; text before
    the first is the reply's content, streamed as it comes. Empty for a
    tokenizer's own ``response_template``, which is parsed from the reply's
    first character. ``spec``: the transformers ``response_template`` the
    section is parsed with; None for a reply that is one JSON object (Llama
    3.x), read whole. ``grammar``: how a constrained turn writes calls; None
    where kvchat cannot constrain this markup (a tokenizer's own
    ``response_template``, whose markup kvchat does not know).
    """

    name: str
    markers: tuple[str, ...]
    spec: dict | None
    grammar: CallGrammar | None = None
    arguments_key: str = "arguments"
    mistral_ids: bool = False  # Mistral's templates refuse ids other than 9 letters or digits
    # Each call ends with a close marker: one the reply ended inside is cut short.
    closed: bool = True
    # Markup around the calls that is not content (Kimi's section markers).
    ignore: tuple[str, ...] = ()
    # The whole reply is channels (gpt-oss's harmony): parsed from its first
    # character, held to its end, and without a call its content is what its
    # "final" channel says (and any text outside the channels), not the
    # markup as it came.
    channels: bool = False
    # A message header the reply ended inside (cut by max_tokens or a stop
    # string): dropped from the content's end, as the markup it is.
    unfinished: str | None = None

    def new_id(self) -> str:
        if self.mistral_ids:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"


def _section(open_pattern: str, close: str | None, content: str, transform, **more) -> dict:
    """A response_template for a tool-call section: repeated call regions, and
    the text around them as content (the implicit field). ``close`` is a
    literal, so a call is closed the moment its marker is complete (what is
    still open when the reply ends was cut short)."""
    calls = {"open_pattern": open_pattern, "repeats": True, "content": content, **more}
    if close is not None:
        calls["close"] = close
    calls["transform"] = transform
    return {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"\A",  # the section is parsed on its own
        "fields": {"tool_calls": calls, "content": {"content": "text"}},
    }


HERMES = ToolFormat(
    "hermes",
    markers=("<tool_call>",),
    spec=_section(r"\s*<tool_call>", "</tool_call>", "json", _CALL_FROM_JSON),
    grammar=CallGrammar("<tool_call>\n", "\n</tool_call>"),
)


def _json_list(name: str, open_tag: str, close_tag: str) -> ToolFormat:
    """OPEN[{"name": ..., "arguments": ...}, ...]CLOSE: a JSON list of calls."""
    return ToolFormat(
        name,
        markers=(open_tag,),
        spec=_section(r"\s*" + re.escape(open_tag), close_tag, "json", _EACH, transform_each=True),
        grammar=CallGrammar(
            "", separator=", ", section_open=open_tag + "[", section_close="]" + close_tag
        ),
    )


APRIEL = _json_list("apriel", "<tool_calls>", "</tool_calls>")  # Apriel 1.5
NEMOTRON_V2 = _json_list("nemotron-v2", "<TOOLCALL>", "</TOOLCALL>")  # Nemotron Nano v2
# MiniMax-M1: one {"name": ..., "arguments": ...} per line in <tool_calls>; a
# call ends with its line (JSON text has no raw newline).
MINIMAX_M1 = ToolFormat(
    "minimax-m1",
    markers=("<tool_calls>",),
    spec=_section(r"\s*(?:<tool_calls>)?\s*(?=\{)", "\n", "json", _CALL_FROM_JSON),
    grammar=CallGrammar(
        "", "\n", separator="", section_open="<tool_calls>\n", section_close="</tool_calls>"
    ),
    ignore=("<tool_calls>", "</tool_calls>"),
)
# Command R7B, Command A: a JSON list of {"tool_call_id", "tool_name", "parameters"},
# one call per indented line. A constrained call leaves the id out: it is
# not the client's id (the template numbers the calls), and no parser needs it.
COHERE = ToolFormat(
    "cohere",
    markers=("<|START_ACTION|>",),
    spec=_section(
        r"\s*<\|START_ACTION\|>",
        "<|END_ACTION|>",
        "json",
        {"type": "function", "function": {"name": "{tool_name}", "arguments": "{parameters}"}},
        transform_each=True,
    ),
    grammar=CallGrammar(
        "",
        separator=",\n    ",
        section_open="<|START_ACTION|>[\n    ",
        section_close="\n]<|END_ACTION|>",
        name_key="tool_name",
        arguments_key="parameters",
    ),
)
QWEN_XML = ToolFormat(  # Qwen3.5, Qwen3-Coder: XML parameters inside <tool_call>
    "qwen-xml",
    markers=("<tool_call>",),
    spec=_section(
        r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
        "</tool_call>",  # the </function> before it is outside every parameter
        "xml-inline",
        _CALL,
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
GLM = ToolFormat(  # GLM-4.5/4.6: <tool_call>NAME <arg_key>k</arg_key><arg_value>v</arg_value>
    "glm",
    markers=("<tool_call>",),
    spec=_section(
        r"\s*<tool_call>(?P<name>[^\n<]+?)\s*(?=<arg_key>|</tool_call>)",
        "</tool_call>",
        "xml-inline",
        _CALL,
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
MINIMAX = ToolFormat(  # MiniMax-M2: <invoke name=...> XML calls in a <minimax:tool_call> block
    "minimax",
    markers=("<minimax:tool_call>",),
    spec=_section(
        r'\s*(?:<minimax:tool_call>)?\s*<invoke name="(?P<name>[^"\n]+)">',
        "</invoke>",
        "xml-inline",
        _CALL,
        content_args={
            "tag_pattern": r'<parameter name="(?P<key>[^"\n]+)">(?P<value>.*?)</parameter>'
        },
    ),
    # As the template renders a call sent back, the newline before the block
    # included; values a string's text, anything else tojson.
    grammar=CallGrammar(
        '<invoke name="',
        "</invoke>\n",
        separator="",
        section_open="\n<minimax:tool_call>\n",
        section_close="</minimax:tool_call>",
        name_in_json=False,
        name_close='">\n',
        xml=('<parameter name="', '">', "</parameter>\n"),
    ),
    ignore=("<minimax:tool_call>", "</minimax:tool_call>"),
)
KIMI = ToolFormat(  # Kimi-K2: a section of calls named functions.NAME:INDEX
    "kimi-k2",
    markers=("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
    spec=_section(
        r"\s*<\|tool_call_begin\|>\s*"
        r"(?:functions\.)?(?P<name>[^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>",
        "<|tool_call_end|>",
        "json",
        _CALL,
    ),
    grammar=CallGrammar(
        "<|tool_call_begin|>functions.",
        "<|tool_call_end|>",
        separator="",
        section_open="<|tool_calls_section_begin|>",
        section_close="<|tool_calls_section_end|>",
        name_in_json=False,
        name_close=":0<|tool_call_argument_begin|>",
    ),
    ignore=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
)
# DeepSeek's markers are special tokens, spelled with a fullwidth bar and "▁".
_DEEPSEEK_CALL, _DEEPSEEK_SEP, _DEEPSEEK_END = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)
_DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_V31 = ToolFormat(  # DeepSeek V3.1: a section of calls, each NAME<｜tool▁sep｜>{...}
    "deepseek-v3.1",
    markers=(_DEEPSEEK_SECTION[0], _DEEPSEEK_CALL),
    spec=_section(
        r"\s*" + re.escape(_DEEPSEEK_CALL) + r"\s*(?P<name>[^\s<]+)\s*" + re.escape(_DEEPSEEK_SEP),
        _DEEPSEEK_END,
        "json",
        _CALL,
    ),
    grammar=CallGrammar(
        _DEEPSEEK_CALL,
        _DEEPSEEK_END,
        separator="",
        section_open=_DEEPSEEK_SECTION[0],
        section_close=_DEEPSEEK_SECTION[1],
        name_in_json=False,
        name_close=_DEEPSEEK_SEP,
    ),
    ignore=_DEEPSEEK_SECTION,
)
LFM2 = ToolFormat(  # LFM2 / LFM2.5: a Python list of calls
    "lfm2",
    markers=("<|tool_call_start|>",),
    spec=_section(
        r"\s*<\|tool_call_start\|>",
        "<|tool_call_end|>",
        "python-call-list",
        _EACH,
        transform_each=True,
    ),
    grammar=CallGrammar(
        "",
        ")",
        separator=", ",
        section_open="<|tool_call_start|>[",
        section_close="]<|tool_call_end|>",
        name_in_json=False,
        name_close="(",
        keyword_arguments=True,
    ),
)
MISTRAL_V11 = ToolFormat(  # Mistral Small 3.2, Devstral: [TOOL_CALLS]NAME[ARGS]{...}
    "mistral-v11",
    markers=("[TOOL_CALLS]",),
    spec=_section(
        r"\s*\[TOOL_CALLS\](?P<name>[^\[\s]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]",
        None,  # a call ends where the next begins, or with the reply
        "json",
        _CALL,
        close_pattern=r"(?=\[TOOL_CALLS\])",
    ),
    grammar=CallGrammar("[TOOL_CALLS]", separator="", name_in_json=False, name_close="[ARGS]"),
    mistral_ids=True,
    closed=False,
)
MISTRAL_V3 = ToolFormat(  # Mistral Nemo: [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
    "mistral",
    markers=("[TOOL_CALLS]",),
    spec=_section(
        r"\s*\[TOOL_CALLS\]",
        None,
        "json",
        _EACH,
        transform_each=True,
    ),
    grammar=CallGrammar("", separator=", ", section_open="[TOOL_CALLS][", section_close="]"),
    mistral_ids=True,
    closed=False,
)
# gpt-oss (harmony): messages in channels. The generation prompt is
# "<|start|>assistant"; the model reasons in "analysis", may address the user
# in "commentary", answers in "final", and calls a function in "commentary"
# (at times "analysis") with a recipient, written after the role (as the
# template renders a call sent back) or in the channel's header (as the model
# usually writes it).
# "<|call|>" and "<|return|>" end the reply, so the decode drops them.
_HARMONY_HEAD = r"(?:<\|start\|>assistant)?\s*"
HARMONY = ToolFormat(
    "harmony",
    markers=(),
    spec={
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"\A",
        "fields": {
            "thinking": {
                "open_pattern": _HARMONY_HEAD + r"<\|channel\|>analysis\s*<\|message\|>",
                "close": "<|end|>",
                "content": "text",
                "repeats": True,
                "join": "",
            },
            "tool_calls": {
                "open_pattern": _HARMONY_HEAD
                + r"(?:to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>(?:commentary|analysis)"
                + r"|<\|channel\|>(?:commentary|analysis)\s+to=functions\.(?P<name>[^\s<]+))"
                + r"\s*(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>",
                "close": "<|call|>",
                "repeats": True,
                "content": "json",
                "transform": _CALL,
            },
            "final": {
                "open_pattern": _HARMONY_HEAD
                + r"<\|channel\|>(?:final|commentary)\s*<\|message\|>",
                "close_pattern": r"<\|end\|>|<\|return\|>",
                "content": "text",
                "repeats": True,
                "join": "",
            },
            "content": {"content": "text"},  # text outside every channel
        },
    },
    # The recipient after the role and no constraint token: as the template
    # renders the call when it is sent back, so the settled history is the reply.
    grammar=CallGrammar(
        " to=functions.",
        separator=None,  # one call a message
        name_in_json=False,
        name_close="<|channel|>commentary json<|message|>",
    ),
    closed=False,  # "<|call|>" ends the reply and is not decoded
    ignore=("<|start|>assistant",),  # a next message's head, cut short
    channels=True,
    # "<|start|>assistant" and a channel header, or either alone, at the end.
    unfinished=(
        r"(?:<\|start\|>(?:assistant)?\s*(?:<\|channel\|>[^<]*(?:<\|constrain\|>[^<]*)?)?|<\|channel\|>[^<]*(?:<\|constrain\|>[^<]*)?)\Z"
    ),
)
LLAMA3_JSON = ToolFormat(  # Llama 3.1-3.3: the whole reply is {"name": ..., "parameters": ...}
    "llama3-json",
    markers=("<|python_tag|>", "{"),
    spec=None,
    grammar=CallGrammar("", separator=None, arguments_key="parameters"),  # one call: the reply
    arguments_key="parameters",
)


SEED_OSS = ToolFormat(  # Seed-OSS: Qwen's XML parameters in <seed:tool_call>, no newlines
    "seed-oss",
    markers=("<seed:tool_call>",),
    spec=_section(
        r"\s*<seed:tool_call>\s*<function=(?P<name>[^>\n]+)>",
        "</seed:tool_call>",
        "xml-inline",
        _CALL,
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
_HY = ":opensource"  # Hy3's tags carry it: <tool_call:opensource>
HY3 = ToolFormat(  # Hy3: GLM's keys and values, a section, NAME<tool_sep:opensource>
    "hy3",
    markers=(f"<tool_calls{_HY}>", f"<tool_call{_HY}>"),
    spec=_section(
        rf"\s*<tool_call{_HY}>(?P<name>[^\n<]+?)<tool_sep{_HY}>",
        f"</tool_call{_HY}>",
        "xml-inline",
        _CALL,
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
        spec=_section(
            rf'\s*(?:<{d}{block}>)?\s*<{d}invoke name="(?P<name>[^"\n]+)">',
            f"</{_DSML}invoke>",
            "xml-inline",
            _CALL,
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
DEEPSEEK_R1 = ToolFormat(  # R1 and its distills: function<｜tool▁sep｜>NAME, then fenced JSON
    "deepseek-r1",
    markers=(_DEEPSEEK_SECTION[0], _DEEPSEEK_CALL),
    spec=_section(
        r"\s*"
        + re.escape(_DEEPSEEK_CALL)
        + r"\s*function\s*"
        + re.escape(_DEEPSEEK_SEP)
        + r"\s*(?P<name>[^\s<`]+)\s*```json",
        "```" + _DEEPSEEK_END,
        "json",
        _CALL,
    ),
    grammar=CallGrammar(
        _DEEPSEEK_CALL + "function" + _DEEPSEEK_SEP,
        "\n```" + _DEEPSEEK_END,
        separator="\n",
        section_open=_DEEPSEEK_SECTION[0],
        section_close=_DEEPSEEK_SECTION[1],
        name_in_json=False,
        name_close="\n```json\n",
    ),
    ignore=_DEEPSEEK_SECTION,
)
GIGACHAT = ToolFormat(  # GigaChat 3.1: <|function_call|>{"name": ..., "arguments": ...}, one call
    "gigachat",
    markers=("<|function_call|>",),
    spec=_section(r"\s*<\|function_call\|>", None, "json", _CALL_FROM_JSON),
    grammar=CallGrammar("<|function_call|>", separator=None),
    closed=False,  # the call ends the reply
)
# Gemma 4: call:NAME{key:<|"|>text<|"|>,key:3}, JSON with bare keys and
# strings between <|"|> marks (transformers' own template for it). Not
# constrained: that is not JSON, which the grammars write.
GEMMA4 = ToolFormat(
    "gemma4",
    markers=("<|tool_call>",),
    spec=_section(
        r"\s*<\|tool_call>call:(?P<name>[^\s{<]+)",
        "<tool_call|>",
        "json",
        _CALL,
        content_args={"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
    ),
)
# Solar Open: each call carries the model's own id. Not constrained: a
# grammar would write one fixed id for every call.
SOLAR = ToolFormat(
    "solar",
    markers=("<|tool_calls|>", "<|tool_call:begin|>"),
    spec=_section(
        r"\s*<\|tool_call:begin\|>[^<]*<\|tool_call:name\|>(?P<name>[^\s<]+)<\|tool_call:args\|>",
        "<|tool_call:end|>",
        "json",
        _CALL,
    ),
    ignore=("<|tool_calls|>", "<|calls|>"),
)


def detect(tokenizer) -> ToolFormat | None:
    """The tool-call format of ``tokenizer``'s chat template, or None when it
    renders tool calls in a markup kvchat does not recognize (tool calls then
    stay text). A tokenizer's own ``response_template`` comes first."""
    own = getattr(tokenizer, "response_template", None)
    calls = own.get("fields", {}).get("tool_calls") if isinstance(own, dict) else None
    if isinstance(calls, dict):
        markers = calls.get("open")
        markers = (markers,) if isinstance(markers, str) else tuple(markers or ())
        closed = "close" in calls  # a literal: complete the moment it is written
        return ToolFormat("response_template", markers=markers, spec=own, closed=closed)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders tools
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str):
        return None
    if "<|channel|>" in template and "<|call|>" in template:
        return HARMONY
    if "<seed:tool_call>" in template:
        return SEED_OSS
    if _HY in template and "<tool_sep" in template:  # Hy3 builds its tags with format()
        return HY3
    if "DSML" in template and "invoke name=" in template:
        return DEEPSEEK_V32 if "function_calls>" in template else DEEPSEEK_V4
    if "<|START_ACTION|>" in template:
        return COHERE
    if "<|tool_call>" in template and "<tool_call|>" in template:
        return GEMMA4
    if "<|tool_call:begin|>" in template:
        return SOLAR
    if "<|function_call|>" in template:
        return GIGACHAT
    if "<TOOLCALL>" in template:
        return NEMOTRON_V2
    if "<|tool_call_begin|>" in template:
        return KIMI
    if _DEEPSEEK_SEP in template:
        # R1 and its distills write type<｜tool▁sep｜>name and fenced JSON.
        return DEEPSEEK_R1 if "```json" in template else DEEPSEEK_V31
    if "<minimax:tool_call>" in template:
        return MINIMAX
    if "<|tool_call_start|>" in template:
        return LFM2
    if "<tool_call>" in template and "<arg_key>" in template:
        return GLM
    if "<tool_call>" in template and "<function=" in template:
        return QWEN_XML
    if "<tool_calls>[" in template:
        return APRIEL
    if "<tool_calls>" in template and "<invoke" not in template:  # JSON lines, not a list
        return MINIMAX_M1
    if "<tool_call>" in template and "<invoke" not in template:  # MiniMax's XML is not JSON
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL_V11 if "[ARGS]" in template else MISTRAL_V3
    if '"parameters"' in template and ("<|python_tag|>" in template or "<|eot_id|>" in template):
        return LLAMA3_JSON
    return None
