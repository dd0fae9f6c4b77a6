"""What agents need from a chat turn: tool calls parsed out of replies
(``formats``, ``toolcalls``) and grammar-constrained decoding (``grammar``)."""

from .formats import ToolFormat, detect
from .toolcalls import Content, ToolCall, ToolCallParser

__all__ = ["Content", "ToolCall", "ToolCallParser", "ToolFormat", "detect"]
