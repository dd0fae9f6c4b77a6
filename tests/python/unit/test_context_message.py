"""kvchat serve's context-length message names the request's own field."""

from __future__ import annotations

from kvchat.serve.chat_request import parse_chat_request
from kvchat.serve.turns import _context_message

LIBRARY = "prompt of 30 tokens plus max_new_tokens=512 exceeds max_context_length=256"


def _chat(**fields):
    return parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_a_default_max_tokens_says_where_it_came_from():
    message = _context_message(LIBRARY, _chat(), 512)
    assert message == (
        "prompt of 30 tokens plus max_tokens=512 exceeds max_context_length=256 (the request "
        "sent no max_tokens: --default-max-tokens 512 applies); send fewer or shorter "
        "messages or a smaller max_tokens"
    )


def test_max_completion_tokens_is_named_as_sent():
    message = _context_message(LIBRARY, _chat(max_completion_tokens=512), 512)
    assert "plus max_completion_tokens=512 exceeds" in message
    assert "max_new_tokens" not in message and "--default-max-tokens" not in message
