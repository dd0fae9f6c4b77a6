"""Tool-call formats: how a chat template's model writes a tool call.

A format is chosen from the chat template's text (the markup it renders an
assistant's ``tool_calls`` with), never from a model's name. Each one is a
transformers ``response_template`` (transformers' own declarative response
parsing, ``transformers.utils.chat_parsing``) for the tool-call section, the
literal markers that open that section, and how a constrained turn writes one
call (``grammar.py``). A tokenizer that carries its own ``response_template``
is parsed with that instead.

One module per markup family (``base`` holds the shapes they share);
``registry`` holds the order ``detect`` tries them in.
"""

from .base import CallGrammar, ToolFormat
from .cohere import COHERE
from .deepseek import DEEPSEEK_R1, DEEPSEEK_V4, DEEPSEEK_V31, DEEPSEEK_V32
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
from .registry import RULES, Rule, detect, detect_template
from .solar import SOLAR

__all__ = [
    "APERTUS",
    "APRIEL",
    "COHERE",
    "DEEPSEEK_R1",
    "DEEPSEEK_V4",
    "DEEPSEEK_V31",
    "DEEPSEEK_V32",
    "GEMMA4",
    "GIGACHAT",
    "GIGACHAT_3",
    "GLM",
    "HARMONY",
    "HERMES",
    "HY3",
    "KIMI",
    "KIMI_K3",
    "LFM2",
    "LLAMA3_JSON",
    "MINIMAX",
    "MINICPM",
    "MINIMAX_M1",
    "MINIMAX_M3",
    "MISTRAL_V3",
    "MISTRAL_V11",
    "NEMOTRON_V2",
    "QWEN_XML",
    "RULES",
    "SEED_OSS",
    "SOLAR",
    "CallGrammar",
    "Rule",
    "ToolFormat",
    "detect",
    "detect_template",
]
