"""The two shapes every format is made of (``ToolFormat``, ``CallGrammar``) and
the transformers ``response_template`` pieces the family modules share."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

# transformers' transform template: every parsed call becomes OpenAI's shape.
CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}
# transform_each: each element of a parsed list of calls.
EACH = {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}
CALL_FROM_JSON = {"type": "function", "function": "{content}"}


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


def section(
    open_pattern: str, close: str | list[str] | None, content: str, transform, **more
) -> dict:
    """A response_template for a tool-call section: repeated call regions, and
    the text around them as content (the implicit field). ``close`` is a
    literal (or a list of them), so a call is closed the moment its marker is complete (what is
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
