"""Local references in a tool's parameters ("#/$defs/X", as pydantic writes
a nested model): moved with the schema, and read through where a parameter's
type decides how it is written (grammar.py) or read back (the parsers cast
a value by its parameter's type)."""

from __future__ import annotations

# Keywords whose values are data, never schemas: a "$ref" inside one is a
# value the tool declares (a const object holding "$ref"), not a reference.
_DATA = frozenset({"const", "enum", "default", "examples"})


def refers(schema) -> bool:
    """Whether ``schema`` holds a local reference ("#..."), at any depth."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(refers(value) for key, value in schema.items() if key not in _DATA)
    if isinstance(schema, list):
        return any(refers(value) for value in schema)
    return False


def relocated(schema, root: str):
    """``schema`` moved under ``root`` (a JSON pointer "#/..."): its local
    references ("#", "#/$defs/X") made to point where it now is."""
    if isinstance(schema, list):
        return [relocated(value, root) for value in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA else relocated(value, root) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def resolved(prop: dict, schema: dict) -> dict:
    """``prop``, or what its local reference into the arguments schema's
    definitions ("#/$defs/X", as pydantic writes) stands for."""
    for _ in range(32):  # a reference to a reference, not a cycle
        ref = prop.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return prop
        target = schema
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return prop
        prop = target
    return prop


def with_refs_resolved(tools: list[dict] | None) -> list[dict] | None:
    """``tools`` with each parameter that is a reference replaced by what it
    refers to (its own references kept, so a parser casts the value by the
    type it has)."""
    if not tools:
        return tools
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            out.append(tool)
            continue
        function = tool.get("function", tool)
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if not isinstance(properties, dict) or not refers(properties):
            out.append(tool)
            continue
        properties = {
            key: resolved(prop, parameters) if isinstance(prop, dict) else prop
            for key, prop in properties.items()
        }
        function = {**function, "parameters": {**parameters, "properties": properties}}
        out.append({**tool, "function": function} if "function" in tool else function)
    return out
