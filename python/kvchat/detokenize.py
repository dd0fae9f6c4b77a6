"""Text from token ids as they arrive: each token's text as soon as it is final.

A word can span many tokens (code, a URL, JSON, a tool call), and one character
can span several (UTF-8 split across byte-level tokens, byte fallback). Holding
text back until a space, as transformers' ``TextIteratorStreamer`` does, delays
a stream's first piece by a whole word.

Text is final once it cannot change with more tokens. Decoders write U+FFFD
for bytes that are not (yet) a whole character, and an incomplete character
is at most 3 bytes, so at most the last 3 of a trailing run of U+FFFD are held
back. ``tokenizers``' ``DecodeStream`` instead holds everything while the text
ends in U+FFFD, which a model writing invalid bytes (any random model; a real
one now and then) keeps doing for the rest of the reply.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvchat")

_REPLACEMENT = "\ufffd"
_LONGEST_INCOMPLETE = 3  # bytes of a UTF-8 character short of its last
# A window still unsettled after this many tokens is invalid bytes for good:
# release it all, so a stream of them costs bounded work per token.
_MAX_WINDOW = 64


def _held(text: str) -> int:
    """How many characters at the end of ``text`` may still change."""
    run = len(text) - len(text.rstrip(_REPLACEMENT))
    return min(run, _LONGEST_INCOMPLETE)


class IncrementalText:
    """Feed token ids one at a time; ``push`` returns the text that became final.

    Each step decodes a short window: the ids since the text last settled,
    after one id of context (a SentencePiece word's leading space shows only
    after another token). Joined, the pieces ``push`` and ``finish`` return
    are ``tokenizer.decode(ids, skip_special_tokens=True)`` of every id pushed.

    ``skip_special_tokens=False`` keeps special tokens (a tool call's markers
    may be special), except ``end_ids``, the ids that end the reply."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, end_ids=()):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._end = frozenset(end_ids)
        self._ids: list[int] = []
        self._start = 0  # the window is ids[_start:]
        self._window_sent = 0  # characters of the window's text already returned
        self._sent = ""  # every piece returned so far
        self._special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        if token_id in self._end:
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._start :])
        final = len(text) - _held(text)
        if len(self._ids) - self._start > _MAX_WINDOW:
            final = len(text)
        piece = text[self._window_sent : final]
        self._window_sent = max(self._window_sent, final)
        if self._window_sent == len(text) and (token_id not in self._special or not self._skip):
            # Settled: the last id becomes the next window's context. Not a
            # special one, which decodes to nothing: the next id would then
            # decode as the first, and SentencePiece drops a first space.
            self._start = len(self._ids) - 1
            self._window_sent = len(self._decode(self._ids[self._start :]))
        self._sent += piece
        return piece

    def finish(self) -> str:
        """What is left at the end (bytes that never formed a character decode
        as U+FFFD, as in a whole decode)."""
        text = self._decode(self._ids)
        if not text.startswith(self._sent):  # what was sent stays sent
            logger.warning("kvchat: streamed text departs from the decoded reply")
            return ""
        rest, self._sent = text[len(self._sent) :], text
        return rest
