"""The chat request's fields that decide what a reply may be: its tools
(checked so kvchat can call them and constrain a reply to them),
``tool_choice`` and ``response_format``."""

from __future__ import annotations

import re
import reprlib

from ..prompting import check_json
from .errors import bad_request

# A tool's name, as OpenAI allows it (and dots, which some templates write).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_tool(function: dict, where: str, kind="function") -> None:
    """A function tool kvchat can call and constrain: OpenAI's name rule, and
    parameters that are a JSON schema of an object (arguments are an object)."""
    if kind != "function":
        raise bad_request(f"{where}.type", f"kvchat serve runs function tools only, got {kind!r}")
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise bad_request(
            f"{where}.name",
            f"a tool's name must be 1 to 64 letters, digits, '_', '-' or '.', got "
            f"{reprlib.repr(name)}",
        )
    parameters = function.get("parameters")
    if parameters is not None and not _object_schema(parameters):
        raise bad_request(
            f"{where}.parameters",
            "a tool's parameters must be a JSON schema of an object, got "
            f"{reprlib.repr(parameters)}",
        )


# What a schema with no "type" may hold and still describe only objects.
_OBJECT_KEYWORDS = {
    "properties", "required", "additionalProperties", "description", "title", "$defs",
    "definitions", "$schema", "$id", "patternProperties", "minProperties", "maxProperties",
}  # fmt: skip


def _object_schema(schema) -> bool:
    if not isinstance(schema, dict):
        return False
    if "type" in schema:
        return schema["type"] == "object"
    return set(schema) <= _OBJECT_KEYWORDS


def parse_tool_choice(value, tools: list | None) -> tuple[str, str | None]:
    """("auto" | "none" | "required", the named function or None)."""
    if value is None or value in ("auto", "none"):
        return value or "auto", None
    names = [t["function"]["name"] for t in tools or []]
    if value == "required":
        if not names:
            raise bad_request("tool_choice", "tool_choice 'required' needs tools")
        return "required", None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            "tool_choice",
            "tool_choice must be 'auto', 'none', 'required' or "
            f"{{'type': 'function', 'function': {{'name': str}}}}, got {reprlib.repr(value)}",
        )
    if name not in names:
        raise bad_request(
            "tool_choice", f"tool_choice names {name!r}, which is not among the tools"
        )
    return "required", name


def parse_response_format(value) -> dict | None:
    """The JSON schema a reply must match, or None for plain text."""
    if value is None or value == {"type": "text"}:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format",
                "response_format json_schema needs "
                "{'json_schema': {'name': str, 'schema': object}}",
            )
        try:
            check_json(schema, "response_format")
        except ValueError as error:
            raise bad_request("response_format", str(error)) from None
        return schema
    raise bad_request(
        "response_format",
        "response_format type must be 'text', 'json_object' or 'json_schema', got "
        f"{reprlib.repr(value)}",
    )
