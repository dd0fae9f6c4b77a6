"""Grammar-constrained decoding with llguidance: ``tool_choice`` "required" or
a named function, and ``response_format`` JSON (docs/agents.md says why
llguidance and not xgrammar).

A constrained turn passes a fresh ``GrammarProcessor`` to ``generate`` as a
logits processor: it masks every token the grammar does not allow next, so the
reply is the grammar's whatever the weights. Plain ``generate`` with the same
processor gives the same tokens; kvchat's reuse is unchanged (the processor
sees only the generated tokens).
"""

from __future__ import annotations

import json
import logging
import re
import threading

import numpy as np
import torch
from transformers import LogitsProcessor

from .formats import CallGrammar, ToolFormat
from .refs import refers as _refers
from .refs import relocated as _relocated
from .refs import resolved as _resolved
from .unclosed import unclosed

logger = logging.getLogger("kvchat.agents")

# What one request's grammar may cost. llguidance bounds each decoding step
# (its LLParserLimits: lexer fuel, Earley items), but not the compile, which
# grows with the grammar's text (up to about 1.3 us a byte on this CPU, over
# the schema shapes tried): 256 KiB is some 0.35 s.
MAX_GRAMMAR_BYTES = 256 * 1024
# How many of the tokens every reply starts with (llguidance's fast-forward
# tokens) a new processor walks to find an error there before the turn.
_FORCED_WALK = 16
_MESSAGE_CHARS = 300  # of llguidance's error: its first line, never the grammar

# Compact JSON with the spaces json.dumps and Jinja's tojson write: no free
# whitespace, which a random or weak model can repeat until max_tokens, and
# the text a template renders when the call is sent back.
_JSON_STYLE = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A schema or grammar llguidance refuses; names the request field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _import():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as error:  # an optional dependency: kvchat[serve] has it
        raise ImportError(
            "constrained decoding needs llguidance: pip install 'kvchat[serve]' (or llguidance)"
        ) from error
    return llguidance


class Grammars:
    """Builds grammars for one tokenizer and model; the llguidance tokenizer
    (about a second to build) is made on first use and shared. A grammar
    over ``max_grammar_bytes`` is refused before it compiles (a CPU bound)."""

    def __init__(
        self, tokenizer, vocab_size: int, end_ids, max_grammar_bytes: int = MAX_GRAMMAR_BYTES
    ):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._end_ids = sorted(end_ids)
        self.max_grammar_bytes = max_grammar_bytes
        self._lock = threading.Lock()
        self._ll = None

    def _ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                llguidance = _import()
                self._ll = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self._vocab_size, eos_token=self._end_ids
                )
            return self._ll

    def tool_calls(
        self,
        fmt: ToolFormat,
        tools: list[dict],
        parallel: bool = True,
        or_json: dict | None = None,
    ) -> str:
        """A grammar for replies that are one or more calls (one unless
        ``parallel``), in ``fmt``'s markup, of one of ``tools`` with arguments
        its parameters allow; or, given ``or_json`` (a schema), that JSON
        instead (``tool_choice: "auto"`` beside a ``response_format``)."""
        g = fmt.grammar
        if g is None:
            raise GrammarError(
                "tool_choice",
                f"this model's tool-call format ({fmt.name}) cannot be constrained; "
                "use tool_choice 'auto'",
            )
        rules = []
        for tool in tools:
            self._check_literals(fmt, tool)
        if g.name_in_json:
            calls, definitions = [], {}
            for i, tool in enumerate(tools):
                arguments = _parameters(tool)
                if _refers(arguments):
                    # "#/..." in a tool's parameters means their root, not the wrapper's.
                    definitions[f"{_TOOL}{i}"] = _relocated(arguments, f"#/$defs/{_TOOL}{i}")
                    arguments = {"$ref": f"#/$defs/{_TOOL}{i}"}
                calls.append(
                    {
                        "type": "object",
                        "properties": {
                            g.name_key: {"const": tool["function"]["name"]},
                            g.arguments_key: arguments,
                        },
                        "required": [g.name_key, g.arguments_key],
                        "additionalProperties": False,
                    }
                )
            wrapper = {"anyOf": calls, "x-guidance": _JSON_STYLE}
            if definitions:
                wrapper["$defs"] = definitions
            rules.append(f"call_json: %json {json.dumps(wrapper)}")
            call = self._seq(g.call_open, "call_json", g.call_close)
        else:
            alternatives = []
            for i, tool in enumerate(tools):
                name = tool["function"]["name"]
                if not g.keyword_arguments and re.search(r'[\s<>"\[:]', name):
                    # The parsers read a written name up to one of these.
                    raise GrammarError(
                        "tool_choice",
                        f"tools: tool name {name!r} cannot be written in this model's "
                        'tool-call markup (it holds whitespace or one of < > " [ :)',
                    )
                if g.keyword_arguments:
                    _check_python_name(name, tool, "tool name")
                    rules.append(f"arguments_{i}: {self._keyword_arguments(tool, i, rules)}")
                elif g.xml is None:
                    schema = {**_parameters(tool), "x-guidance": _JSON_STYLE}
                    rules.append(f"arguments_{i}: %json {json.dumps(schema)}")
                else:
                    arguments = self._xml_arguments(g, tool, i, rules)
                    rules.append(f"arguments_{i}: {arguments}")
                alternatives.append(
                    self._seq(
                        g.call_open + name + g.name_close,
                        f"arguments_{i}",
                        g.call_close,
                    )
                )
            call = " | ".join(f"({a})" for a in alternatives)
        rules.append(f"call: {call}")
        calls = "call"
        if parallel and g.separator is not None:
            calls = f"call ({self._seq(g.separator, 'call')})*"
        section = self._seq(g.section_open, calls, g.section_close)
        if or_json is not None:
            self._check_json_literals(or_json)
            rules.append(f"value: %json {json.dumps({**or_json, 'x-guidance': _JSON_STYLE})}")
            return "start: (" + section + ") | value\n" + "\n".join(rules) + "\n"
        return f"start: {section}\n" + "\n".join(rules) + "\n"

    def _check_literals(self, fmt: ToolFormat, tool: dict) -> None:
        """Refuses a tool whose schema gives a text (a property name, an enum
        or const string) the grammar cannot write as text inside a call: one
        that holds a special token's text, which llguidance writes as that
        token (an end token ends the reply there); and in the XML formats,
        one that holds "</", where the parser splits a call."""
        name = tool["function"]["name"]
        specials = self._specials()
        for where, text in _literals(tool["function"].get("parameters"), "parameters"):
            found = [s for s in specials if s in text]
            closing = fmt.grammar.xml is not None and "</" in text
            if found or closing:
                why = f"the special token {found[0]!r}" if found else "'</'"
                raise GrammarError(
                    "tool_choice",
                    f"tools: tool {name!r}, {where}: {text[:80]!r} holds {why}, which "
                    f"cannot be written inside a call in this model's tool-call markup "
                    f"({fmt.name})",
                )

    def _check_json_literals(self, schema) -> None:
        """Refuses a response_format whose schema gives a text holding a
        special token's text: llguidance writes it as that token, so an end
        token ends the reply inside the JSON (beside tools it came back as
        broken JSON; alone, as llguidance's own cryptic refusal)."""
        specials = self._specials()
        for where, text in _literals(schema, "schema"):
            found = [s for s in specials if s in text]
            if found:
                raise GrammarError(
                    "response_format",
                    f"response_format: {where}: {text[:80]!r} holds the special token "
                    f"{found[0]!r}, which cannot be written inside the JSON",
                )

    def _specials(self) -> list[str]:
        """The texts the tokenizer writes as special tokens, longest first."""
        # Markers a tokenizer added as special tokens (gpt-oss's "<|channel|>",
        # LFM2's "<|tool_call_start|>") are not all in all_special_tokens.
        added = getattr(self._tokenizer, "added_tokens_decoder", {}).values()
        specials = set(getattr(self._tokenizer, "all_special_tokens", ()))
        specials |= {t.content for t in added if getattr(t, "special", False)}
        return sorted((s for s in specials if s), key=len, reverse=True)

    def _xml_arguments(self, g: CallGrammar, tool: dict, i: int, rules: list) -> str:
        """Lark for a tool's parameters as tagged values, in the schema's
        order, the required ones always. The parser reads each value back as
        text, cast by the tool's schema only where it allows no string: so a
        value that may be a string (or has no type) is written as its text, a
        choice of strings as one of them, a boolean as the template writes
        it, and anything else as compact JSON."""
        key_open, key_close, value_close = g.xml
        schema = _parameters(tool)
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        parts = []
        for j, (key, prop) in enumerate(properties.items()):
            if not isinstance(key, str) or not key or re.search(r'[<>"\n]', key):
                # The parser reads a key up to the first '>', '"' (MiniMax) or newline.
                raise GrammarError(
                    "tool_choice",
                    f"tools: parameter {key!r} of {tool['function']['name']!r} cannot be "
                    "written in this model's tool-call markup (it holds '<', '>', '\"' or "
                    "a newline)",
                )
            value, close, opened = f"value_{i}_{j}", value_close, key_close
            prop = prop if isinstance(prop, dict) else {}
            # What a value may be, read through a reference to the definitions.
            shape = _resolved(prop, schema)
            choices = shape.get("enum", [shape["const"]] if "const" in shape else None)
            types = _types(shape)
            if choices and all(isinstance(c, str) for c in choices):
                literals = (self._literal(c) or '""' for c in choices)
                rules.append(f"{value}: " + " | ".join(literals))
            elif types and "string" not in types:  # the parser casts the text back
                opened = g.xml_json_key_close or key_close
                if types == {"boolean"} and g.python_scalars:
                    rules.append(f'{value}: "True" | "False"')
                else:
                    try:  # the parser splits the call at a "</" in the JSON
                        value_schema = unclosed({**prop, **_definitions(schema)})
                    except ValueError as e:
                        raise GrammarError(
                            "tool_choice",
                            f"tools: parameter {key!r} of {tool['function']['name']!r}: {e} "
                            "cannot be kept free of '</' in this model's XML tool-call "
                            "markup, where '</' ends the call",
                        ) from None
                    schema_text = json.dumps({**value_schema, "x-guidance": _JSON_STYLE})
                    rules.append(f"{value}: %json {schema_text}")
            elif choices:  # text the parser would not cast back to these values
                raise GrammarError(
                    "tool_choice",
                    f"tools: parameter {key!r} of {tool['function']['name']!r}: a choice of "
                    "values that are not all strings needs a 'type' other than string in "
                    "this model's tool-call markup",
                )
            else:
                body, close = self._text_until(close)
                rules.append(value + body)
            part = self._seq(key_open + key + opened, value, close)
            parts.append(part if key in required else f"({part})?")
        return " ".join(parts) or '""'

    def _keyword_arguments(self, tool: dict, i: int, rules: list) -> str:
        """Lark for a tool's parameters as Python keyword arguments
        (``key=VALUE, ...``, LFM2), in the schema's order, the required ones
        always. A value is written as LFM2's template writes it where the
        parser reads that back the same (a plain string in single quotes, a
        boolean as True or False, None), and as compact JSON otherwise, which
        the parser also reads (JSON's true, false and null included)."""
        schema = _parameters(tool)
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        pieces = []  # (Lark for key=VALUE, required)
        for j, (key, prop) in enumerate(properties.items()):
            _check_python_name(key, tool, "parameter")
            value = f"value_{i}_{j}"
            prop = prop if isinstance(prop, dict) else {}
            shape = _resolved(prop, schema)
            rules.append(f"{value}: {self._python_value(shape, _definitions(schema))}")
            pieces.append((f"{self._literal(key + '=')} {value}", key in required))
        if not pieces:
            return '""'
        # The parameters written, joined by ", ": after the first one written,
        # each is ", " then itself; before it, an optional one may be left out.
        later = [f'(", " {p})' + ("" if req else "?") for p, req in pieces]
        first = '""'
        for k in range(len(pieces) - 1, -1, -1):
            piece, req = pieces[k]
            written = " ".join([piece, *later[k + 1 :]])
            first = written if req else f"({written}) | ({first})"
        return first

    def _python_value(self, prop: dict, definitions: dict) -> str:
        choices = prop.get("enum", [prop["const"]] if "const" in prop else None)
        types = _types(prop)
        if choices and all(isinstance(c, str) for c in choices):
            return " | ".join(self._literal(_python_string(c)) for c in choices)
        constrained = {"pattern", "format", "minLength", "maxLength"} & set(prop)
        if not choices and types == {"string"} and not constrained:
            # Single quotes and no escapes, as the template writes it; no "<|",
            # which would start the call's closing marker.
            return r"/'([^'\\\n\r<]|<+[^'\\\n\r<|])*<*'/"
        if not choices and types == {"boolean"}:
            return '"True" | "False"'
        if not choices and types == {"null"}:
            return '"None"'
        value = _bounded({**prop, **definitions})
        value["$defs"] = {**value.get("$defs", {}), _ANY: _BOUNDED_ANY}
        return f"%json {json.dumps({**value, 'x-guidance': _JSON_STYLE})}"

    def _text_until(self, close: str) -> tuple[str, str]:
        """(a rule body, after its name, for a string written as its text up
        to ``close``; what of ``close`` is left to write after it). The parser
        splits a call at the first closing tag of any kind (this value's, the
        call's), so the text holds no "</" at all: text then the tag, as one
        lexeme that ends at the tag. A tag that is a special token ends the
        text where the model writes it (its characters spelled as text
        would still be read as it, hence no "</" there either)."""
        text = "(?s:[^<]|<[^\\/<])*"
        tag = close.strip()
        if self._literal(tag).startswith("<["):
            return f": /{text}/", close
        pattern = "".join("\\/" if c == "/" else re.escape(c) for c in tag)
        return f"[lazy]: /{text}{pattern}/", close[close.index(tag) + len(tag) :]

    def json_schema(self, schema: dict) -> str:
        self._check_json_literals(schema)
        schema = dict(schema)
        schema.setdefault("x-guidance", _JSON_STYLE)
        return f"start: value\nvalue: %json {json.dumps(schema)}\n"

    def _seq(self, before: str, rule: str, after: str = "") -> str:
        """Lark for ``before`` ``rule`` ``after``, the texts as literals."""
        return " ".join(p for p in (self._literal(before), rule, self._literal(after)) if p)

    def processor(self, grammar: str, param: str) -> GrammarProcessor:
        """A fresh processor for one turn. GrammarError (naming ``param``, the
        request field) for a grammar over ``max_grammar_bytes`` or one
        llguidance refuses: when it builds it, at the first token's mask, or
        on the tokens every reply starts with. Where it refuses later, the
        processor ends the reply and holds the error (``GrammarProcessor.error``)."""
        size = len(grammar.encode("utf-8", "surrogatepass"))
        if size > self.max_grammar_bytes:
            raise GrammarError(
                param,
                f"{param}: its grammar is {size} bytes, over the {self.max_grammar_bytes} "
                "kvchat compiles for one request (a smaller schema, or fewer tools)",
            )
        llguidance = _import()
        # verbose_errors=False: llguidance's error states no parser state or grammar.
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0, limits=limits)
        first = None if matcher.is_error() else matcher.compute_bitmask()
        error = matcher.get_error() or _forced_error(matcher.deep_copy())
        if error:
            raise GrammarError(param, f"{param}: llguidance refuses its grammar: {short(error)}")
        return GrammarProcessor(matcher, self._end_ids, first, param)

    def _literal(self, text: str) -> str:
        """``text`` in Lark: special tokens by id (their text is no bytes a
        model writes), the rest as strings."""
        if not text:
            return ""
        specials = [s for s in self._specials() if s in text]  # longest first
        if not specials:
            return json.dumps(text)
        pattern = "(" + "|".join(re.escape(s) for s in specials) + ")"
        parts = []
        for piece in re.split(pattern, text):
            if piece in specials:
                parts.append(f"<[{self._tokenizer.convert_tokens_to_ids(piece)}]>")
            elif piece:
                parts.append(json.dumps(piece))
        return " ".join(parts)


_PYTHON_INT = 2**53 - 1
# A name transformers' python-call-list parser reads (tool and parameter names).
_PYTHON_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:[-.][A-Za-z0-9_]+)*")


# Any JSON value whose numbers, however deep, the parser reads: what
# ``_bounded`` puts where a schema allows any value inside an object or array.
_ANY = "kvchat_bounded_any"
_BOUNDED_ANY = {
    "minimum": -_PYTHON_INT,
    "maximum": _PYTHON_INT,
    "items": {"$ref": f"#/$defs/{_ANY}"},
    "additionalProperties": {"$ref": f"#/$defs/{_ANY}"},
}


def _bounded_any(schema):
    return {"$ref": f"#/$defs/{_ANY}"} if schema is True or schema == {} else _bounded(schema)


def _definitions(schema: dict) -> dict:
    """The arguments schema's definitions, which a parameter's schema, compiled
    on its own, refers to (``#/$defs/...``, as pydantic writes them)."""
    return {key: schema[key] for key in ("$defs", "definitions") if key in schema}


def _bounded(schema):
    """``schema`` with every number it allows within what the parser reads:
    it refuses an integer literal beyond 2**53 - 1 and a float that
    overflows, which JSON for a number, or for a value of any type, may
    write. Walks the subschemas that hold values (properties, items, ...)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: _bounded(sub) for name, sub in schema[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            out[key] = [_bounded(sub) for sub in schema[key]]
    if "$ref" in schema:  # bounded where it is defined ($defs, walked above)
        return out
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    # A value of any type may be an object, an array or a number.
    if kinds is None or "object" in kinds:
        if schema.get("additionalProperties", True) is not False:
            out["additionalProperties"] = _bounded_any(schema.get("additionalProperties", True))
    if kinds is None or "array" in kinds:
        if isinstance(schema.get("items", True), dict) or schema.get("items", True) is True:
            out["items"] = _bounded_any(schema.get("items", True))
    if kinds is None or kinds & {"integer", "number"}:
        for key, limit, pick in (("minimum", -_PYTHON_INT, max), ("maximum", _PYTHON_INT, min)):
            bound = schema.get(key)
            numeric = isinstance(bound, (int, float)) and not isinstance(bound, bool)
            out[key] = pick(bound, limit) if numeric else limit
    return out


def _check_python_name(name, tool: dict, what: str) -> None:
    if not isinstance(name, str) or not _PYTHON_NAME.fullmatch(name):
        raise GrammarError(
            "tool_choice",
            f"tools: {what} {name!r} of {tool['function']['name']!r} cannot be written in "
            "this model's tool-call markup (a Python call: letters, digits and '_', "
            "with '-' or '.' only between them, not starting with a digit)",
        )


def _python_string(text: str) -> str:
    """``text`` as a Python string literal the parser reads back: in single
    quotes as the template writes it, or as JSON where that would need an
    escape."""
    if any(c in text for c in "'\\\n\r"):
        return json.dumps(text)
    return f"'{text}'"


def _types(prop: dict) -> set[str]:
    """The JSON types a property allows, from ``type`` (one or a list) and
    the branches of ``anyOf`` / ``oneOf`` (empty: any type)."""
    types = prop.get("type")
    found = set([types] if isinstance(types, str) else types or ())
    for branch in (prop.get("anyOf") or []) + (prop.get("oneOf") or []):
        if not isinstance(branch, dict):
            continue
        branch_types = _types(branch)
        if not branch_types:
            return set()  # a branch of any type
        found |= branch_types
    return found


def _parameters(tool: dict) -> dict:
    """A tool's arguments schema (an object, when it gives none), strict: an
    object that does not say ``additionalProperties`` has no other keys."""
    parameters = tool["function"].get("parameters")
    parameters = parameters if isinstance(parameters, dict) and parameters else {"type": "object"}
    return _strict(parameters)


# Subschemas that describe values, by how they hold them.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _strict(schema, branch: bool = False, inherited: tuple = ()):
    """``schema`` with ``additionalProperties: false`` on every object schema
    that leaves it unsaid, at any depth, as xgrammar's default strict mode
    reads it: under a grammar, a free key is a string a model may never
    close. An explicit ``true`` (or a schema) keeps extra keys. The branches
    of an ``allOf`` are left open, since each describes part of one object.

    An object and its ``anyOf`` / ``oneOf`` branches describe one object
    ("a, and b or c"), but llguidance closes each on its own keys: so a
    closed branch also allows the keys its parent names (``inherited``), and
    a closed parent those its branches name."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    own = tuple(_names(schema))
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            out[key] = _strict(schema[key])
    for key in _MANY:
        if isinstance(schema.get(key), list):
            named = inherited + own if key in ("anyOf", "oneOf") else ()
            out[key] = [_strict(sub, key == "allOf", named) for sub in schema[key]]
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _strict(sub) for name, sub in schema[key].items()}
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    objects = "object" in kinds or (not kinds and "properties" in schema)
    if objects and not branch and "additionalProperties" not in schema:
        out["additionalProperties"] = False
        # The keys the parent and the branches name, allowed here (any value:
        # where they are named, they are constrained).
        branches = [b for key in ("anyOf", "oneOf", "allOf") for b in _list(schema.get(key))]
        before = {name: {} for name in inherited if name not in own}
        after = {n: {} for b in branches for n in _names(b) if n not in own and n not in before}
        if before or after:  # in the order the parent, then the branch, names them
            out["properties"] = {**before, **(out.get("properties") or {}), **after}
    return out


def _names(schema) -> list:
    """The property names an object schema declares (none if it is not one)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return list(properties) if isinstance(properties, dict) else []


def _list(value) -> list:
    return value if isinstance(value, list) else []


_TOOL = "kvchat_tool_"  # a tool's parameters, as a definition of the calls' schema


def _literals(schema, where: str):
    """(where, text) for every text a grammar writes as it is given in
    ``schema``: property names (``properties`` and ``required``), and the
    strings of ``enum`` and ``const`` values, at any depth."""
    if isinstance(schema, list):
        for k, value in enumerate(schema):
            yield from _literals(value, f"{where}[{k}]")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in ("enum", "const"):
            for text in _strings(value):
                yield f"{where}.{key}", text
        elif key == "properties" and isinstance(value, dict):
            for name, sub in value.items():
                yield f"{where}.properties", name
                yield from _literals(sub, f"{where}.properties[{name!r}]")
        elif key == "required" and isinstance(value, list):
            # A required key no property names is still written as it is given.
            yield from ((f"{where}.required", n) for n in value if isinstance(n, str))
        elif isinstance(value, (dict, list)):
            yield from _literals(value, f"{where}.{key}")


def _strings(value):
    """Every string in a JSON value: its keys and strings, at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)


class GrammarProcessor(LogitsProcessor):
    """Masks the tokens the grammar does not allow next. One sequence, one
    turn: the first call's length is the prompt, later tokens are the reply.

    Where llguidance refuses the grammar while decoding (a parser limit
    reached on the tokens written so far), the processor raises nothing: it
    keeps the error in ``error`` (a GrammarError naming the request field) and
    from then on allows only ``end_ids``, so ``generate`` ends the reply
    there. An exception inside ``generate`` would fail the whole turn, and a
    session drops its cache when a turn fails (docs/errors.md)."""

    def __init__(
        self, matcher, end_ids=(), first_mask: bytes | None = None, param: str = "grammar"
    ):
        self._matcher = matcher
        self._end_ids = list(end_ids)
        self._first = first_mask  # computed when it was built: the first step's mask
        self._param = param
        self._seen: int | None = None
        self.error: GrammarError | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        if input_ids.shape[0] != 1:
            raise ValueError("a grammar constrains one sequence, not a batch")
        bits = None if self.error is not None else self._next_mask(input_ids)
        if bits is None:  # refused: only the end of the reply is left to write
            allowed = np.zeros(scores.shape[-1], bool)
            allowed[[i for i in self._end_ids if 0 <= i < allowed.size]] = True
        else:
            allowed = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")
            allowed = allowed[: scores.shape[-1]].astype(bool)
        if allowed.size < scores.shape[-1]:  # ids past the tokenizer's: never allowed
            allowed = np.concatenate([allowed, np.zeros(scores.shape[-1] - allowed.size, bool)])
        mask = torch.from_numpy(~allowed).to(scores.device)
        return scores.masked_fill(mask, float("-inf"))

    def _next_mask(self, input_ids: torch.LongTensor) -> bytes | None:
        """The next token's mask; None once llguidance refuses the grammar."""
        if self._seen is not None:
            for token in input_ids[0, self._seen :].tolist():
                if not self._matcher.consume_token(token):
                    return self._refused(f"at token {token}")
        self._seen = input_ids.shape[1]
        if self._first is not None:  # the first step: nothing consumed yet
            bits, self._first = self._first, None
            return bits
        bits = self._matcher.compute_bitmask()
        if self._matcher.is_error():
            return self._refused("computing the next token's mask")
        return bits

    def _refused(self, where: str) -> None:
        message = short(self._matcher.get_error())
        self.error = GrammarError(
            self._param, f"{self._param}: llguidance refused its grammar while decoding: {message}"
        )
        logger.warning("kvchat: a grammar failed %s; the reply ends here: %s", where, message)
        return None


def _forced_error(matcher) -> str:
    """llguidance's error on the first tokens every reply under ``matcher``
    writes (its fast-forward tokens: the mask allows nothing else), if any:
    a grammar it builds may refuse the very first token (a row of more than
    2,000 alternatives, a required ``$ref`` to itself), which is found here,
    before the turn, rather than once the reply has begun."""
    for token in matcher.compute_ff_tokens()[:_FORCED_WALK]:
        if not matcher.consume_token(token):
            return matcher.get_error()
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher.get_error()


def short(message: str) -> str:
    """llguidance's error as a client or a log line gets it: its first line,
    at most a few hundred characters (a compile error goes on to quote the
    grammar, which can be megabytes of the client's schema)."""
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= _MESSAGE_CHARS else line[: _MESSAGE_CHARS - 3] + "..."
