"""JSON values with no "</" in their strings, for the XML markups.

The XML formats' parsers split a call at the first "</" (a closing tag of
any kind), so a parameter written as compact JSON (an object, an array, a
number) must hold none: a string in it that holds ``</tool_call>`` would end
the call there, and the call would come back as text. JSON writes "</" only
inside a string (a key or a value), so ``unclosed`` gives every string a
schema allows a pattern without "</"; llguidance reads a pattern on the
decoded text and writes no escape for "<" or "/", so none can slip through
as ``\\u003c`` or ``\\/``. Enum and const strings are checked where the tool
is (``Grammars._check_literals``).
"""

from __future__ import annotations

# A text with no "</": a "<" is followed by another "<", a character other
# than "/", or the end.
NO_CLOSE = "^([^<]|<+[^</])*<*$"
ANY = "kvchat_unclosed_any"
# Any JSON value with no "</" in its strings or keys (free keys as
# patternProperties: llguidance has no propertyNames).
ANY_SCHEMA = {
    "pattern": NO_CLOSE,
    "items": {"$ref": f"#/$defs/{ANY}"},
    "patternProperties": {NO_CLOSE: {"$ref": f"#/$defs/{ANY}"}},
    "additionalProperties": False,
}


def unclosed(schema) -> dict:
    """``schema`` (a JSON-valued parameter's, its definitions merged in) with
    no "</" in any string it allows, at any depth; ``$defs`` gains ``ANY``.
    ValueError (saying what) for a part that cannot be so constrained."""
    out = _walk(schema)
    out["$defs"] = {**out.get("$defs", {}), ANY: ANY_SCHEMA}
    return out


def _any(schema):
    return {"$ref": f"#/$defs/{ANY}"} if schema is True or schema == {} else _walk(schema)


def _walk(schema):
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    # Subschemas that hold values ("not" and "if" only test them).
    for key in ("properties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: _walk(sub) for name, sub in schema[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            out[key] = [_walk(sub) for sub in schema[key]]
    for key in ("contains", "then", "else"):
        if isinstance(schema.get(key), dict):
            out[key] = _walk(schema[key])
    if "$ref" in schema:  # constrained where it is defined ($defs, walked above)
        return out
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if kinds is None or "object" in kinds:
        if "patternProperties" in schema:
            raise ValueError("'patternProperties' (its keys could hold '</')")
        extra = schema.get("additionalProperties", True)
        if extra is not False:
            # Free keys without "</", and not the named ones (a pattern that
            # matched them would bind their values to its schema too).
            named = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            out["patternProperties"] = {_free_keys(list(named)): _any(extra)}
            out["additionalProperties"] = False
    if kinds is None or "array" in kinds:
        items = schema.get("items", True)
        out["items"] = _any(items) if items is True or isinstance(items, dict) else items
    if kinds is None or "string" in kinds:
        if "pattern" in schema:  # both patterns; definitions stay at the root
            inner = {k: v for k, v in out.items() if k not in ("$defs", "definitions")}
            outer = {k: v for k, v in out.items() if k in ("$defs", "definitions")}
            return {**outer, "allOf": [inner, {"pattern": NO_CLOSE}]}
        out["pattern"] = NO_CLOSE
    return out


# A text with no "</", and one after a "<" (so not starting with "/").
_TEXT = "([^<]|<+[^</])*<*"
_AFTER_LT = f"([^</]{_TEXT}|<{_TEXT})?"


def _free_keys(names: list[str]) -> str:
    """A pattern for the keys with no "</" that are none of ``names`` (which
    hold none: such a name is refused), walking the names' trie: a key ends
    where no name does, or leaves every name at some character."""
    if not names:
        return NO_CLOSE
    trie: dict = {}
    for name in names:
        node = trie
        for c in name:
            node = node.setdefault(c, {})
        node[None] = {}
    return f"^{_unnamed(trie, after_lt=False)}$"


def _char(c: str) -> str:
    return f"\\x{{{ord(c):X}}}"


def _unnamed(node: dict, after_lt: bool) -> str:
    children = [c for c in node if c is not None]
    ways = [] if None in node else [""]  # ending here is no name
    others = "".join(_char(c) for c in children) + "<" + ("/" if after_lt else "")
    ways.append(f"[^{others}]{_TEXT}")  # leaving every name, by a character
    if "<" not in children:
        ways.append(f"<{_AFTER_LT}")
    ways += [f"{_char(c)}{_unnamed(node[c], c == '<')}" for c in children]
    return "(" + "|".join(ways) + ")"
