"""Which format a chat template writes its tool calls in, read off the
template's text, never a model's name.

Like SGLang's ``function_call`` detectors, each markup family is a module of
its own; this one holds the order they are tried in. The order matters: a
more specific markup comes before one whose markers it contains (Qwen's XML
and GLM's both sit in Hermes' ``<tool_call>``, MiniMax-M3's ``<invoke>``
too).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import ToolFormat
from .cohere import COHERE
from .deepseek import DEEPSEEK_R1, DEEPSEEK_SEP, DEEPSEEK_V4, DEEPSEEK_V31, DEEPSEEK_V32
from .gemma4 import GEMMA4
from .gigachat import GIGACHAT, GIGACHAT_3
from .glm import GLM, HY3
from .harmony import HARMONY
from .hermes import HERMES
from .json_list import APERTUS, APRIEL, NEMOTRON_V2
from .kimi import KIMI, KIMI_K3
from .lfm2 import LFM2
from .llama3 import LLAMA3_JSON
from .minicpm import MINICPM
from .minimax import MINIMAX, MINIMAX_M1, MINIMAX_M3
from .mistral import MISTRAL_V3, MISTRAL_V11
from .qwen_xml import QWEN_XML, SEED_OSS
from .solar import SOLAR


@dataclass(frozen=True)
class Rule:
    """``format`` is a template's that holds every text of ``all`` and none
    of ``none``."""

    format: ToolFormat
    all: tuple[str, ...]
    none: tuple[str, ...] = ()

    def matches(self, template: str) -> bool:
        return all(t in template for t in self.all) and not any(t in template for t in self.none)


# Tried in order; the first that matches wins.
RULES: tuple[Rule, ...] = (
    Rule(HARMONY, ("<|channel|>", "<|call|>")),
    Rule(SEED_OSS, ("<seed:tool_call>",)),
    Rule(HY3, (":opensource", "<tool_sep")),  # Hy3 builds its tags with format()
    Rule(DEEPSEEK_V32, ("DSML", "invoke name=", "function_calls>")),
    Rule(DEEPSEEK_V4, ("DSML", "invoke name=")),
    Rule(COHERE, ("<|START_ACTION|>",)),
    Rule(GEMMA4, ("<|tool_call>", "<tool_call|>")),
    Rule(SOLAR, ("<|tool_call:begin|>",)),
    Rule(GIGACHAT, ("<|function_call|>",)),
    Rule(GIGACHAT_3, ("function call", "<|role_sep|>")),
    Rule(APERTUS, ("<|tools_prefix|>", "<|tools_suffix|>")),
    Rule(NEMOTRON_V2, ("<TOOLCALL>",)),
    Rule(KIMI, ("<|tool_call_begin|>",)),
    Rule(KIMI_K3, ("<|open|>", "<|close|>", "'argument'")),
    # R1 and its distills write type<｜tool▁sep｜>name and fenced JSON.
    Rule(DEEPSEEK_R1, (DEEPSEEK_SEP, "```json")),
    Rule(DEEPSEEK_V31, (DEEPSEEK_SEP,)),
    Rule(MINIMAX, ("<minimax:tool_call>",)),
    Rule(MINIMAX_M3, ("]<]minimax[>[", "<invoke")),
    Rule(MINICPM, ('<function name="', '<param name="')),
    Rule(LFM2, ("<|tool_call_start|>",)),
    Rule(GLM, ("<tool_call>", "<arg_key>")),
    Rule(QWEN_XML, ("<tool_call>", "<function=")),
    Rule(APRIEL, ("<tool_calls>[",)),
    Rule(MINIMAX_M1, ("<tool_calls>",), none=("<invoke",)),  # JSON lines, not a list
    Rule(HERMES, ("<tool_call>",), none=("<invoke",)),  # MiniMax's XML is not JSON
    Rule(MISTRAL_V11, ("[TOOL_CALLS]", "[ARGS]")),
    Rule(MISTRAL_V3, ("[TOOL_CALLS]",)),
    Rule(LLAMA3_JSON, ('"parameters"', "<|python_tag|>")),
    Rule(LLAMA3_JSON, ('"parameters"', "<|eot_id|>")),
)


def detect_template(template: str) -> ToolFormat | None:
    """The format of the first rule ``template`` matches, or None."""
    return next((rule.format for rule in RULES if rule.matches(template)), None)


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
    return detect_template(template)
