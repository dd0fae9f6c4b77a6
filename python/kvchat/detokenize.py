"""Text from token ids as they arrive: each token's text as soon as it is final.

A word can span many tokens (code, a URL, JSON, a tool call), and one character
can span several (UTF-8 split across byte-level tokens, byte fallback). Text
is final once the bytes before it decode whole: holding it back until a space,
as transformers' ``TextIteratorStreamer`` does, delays a stream's first piece by
a whole word. ``tokenizers``' own streaming decoder (``DecodeStream``) does the
work for fast tokenizers; any other tokenizer decodes a short window.
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger("kvchat")

# What a decoder writes for bytes that do not (yet) form a whole character.
_INCOMPLETE = "\ufffd"


class IncrementalText:
    """Feed token ids one at a time; ``push`` returns the text that became final.

    Joined, the pieces ``push`` and ``finish`` return are exactly
    ``tokenizer.decode(ids, skip_special_tokens=True)`` of every id pushed."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._sent = ""  # the text returned so far
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True)
        self._backend = backend if isinstance(backend, Tokenizer) else None
        # The window a tokenizer without a streaming decoder re-decodes: ids
        # from _prefix on give context (a leading space), from _read on are new.
        self._prefix = self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        piece = self._step_fast(token_id) if self._backend is not None else self._step_window()
        self._sent += piece
        return piece

    def finish(self) -> str:
        """What is left at the end (bytes that never formed a character decode
        as U+FFFD, as in a whole decode)."""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if not text.startswith(self._sent):  # never seen; what was sent stays sent
            logger.warning("kvchat: streamed text departs from the decoded reply")
            return ""
        rest, self._sent = text[len(self._sent) :], text
        return rest

    def _step_fast(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception:  # noqa: BLE001 - tokenizers raises its own error type
            # An id the decoder cannot place (outside the vocabulary, say):
            # fall back to the window from here on; finish() reconciles.
            self._backend = None
            self._prefix = self._read = len(self._ids) - 1
            return self._step_window()

    def _step_window(self) -> str:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""  # nothing new, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
