"""Context overflow: a clear error by default, or dropping the oldest turns."""

from __future__ import annotations

import pytest
from helpers import MAX_NEW, SYSTEM, reference_turn, user_message
from kvchat import ContextLengthError, SessionManager
from kvchat.prompting import render_prompt

LIMIT = 200


def long_conversation(turns: int) -> list[dict]:
    messages = [SYSTEM]
    for turn in range(turns):
        messages += [user_message(turn), {"role": "assistant", "content": f"Answer {turn}."}]
    return messages + [user_message(turns)]


def test_default_overflow_raises_with_the_sizes(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, max_context_length=LIMIT)
    with pytest.raises(ValueError, match=rf"plus max_new_tokens={MAX_NEW} exceeds.*={LIMIT}"):
        mgr.chat("s", long_conversation(8), max_new_tokens=MAX_NEW)
    # One class for every context-length refusal (a ValueError), whatever the path.
    prompt = render_prompt(tokenizer, long_conversation(8)).unsqueeze(0)
    for call in (
        lambda: mgr.chat("s", long_conversation(8), max_new_tokens=MAX_NEW),
        lambda: mgr.generate(prompt, session_id="g", max_new_tokens=MAX_NEW),
        lambda: mgr.chat("s", [SYSTEM, user_message(0)], max_new_tokens=LIMIT),
    ):
        with pytest.raises(ContextLengthError, match="max_context_length"):
            call()
    assert mgr.sessions() == []


def test_truncate_drops_the_oldest_whole_turns_and_stays_exact(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, max_context_length=LIMIT, overflow="truncate")
    messages = long_conversation(8)
    assert render_prompt(tokenizer, messages).numel() + MAX_NEW > LIMIT
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    t = mgr.last_turn("s")
    assert t.prompt_tokens + MAX_NEW <= LIMIT
    kept = mgr.messages("s")[:-1]  # the truncated prompt, then the reply
    assert kept[0] == SYSTEM and kept[-1] == messages[-1]  # system and the question stay
    assert kept[1]["role"] == "user" and kept[1] != messages[1]  # oldest turns went first
    assert kept[1:] == messages[len(messages) - len(kept) + 1 :]  # whole turns, in order
    _, _, expected = reference_turn(llama, tokenizer, kept)
    assert t.output_ids == expected

    # The next turn truncates again, and still reuses the system prompt.
    messages += [{"role": "assistant", "content": "Fine."}, user_message(9)]
    mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert mgr.last_turn("s").reused_tokens >= render_prompt(tokenizer, [SYSTEM]).numel() - 5


def test_truncate_cannot_drop_the_question_itself(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, max_context_length=LIMIT, overflow="truncate")
    huge = [SYSTEM, {"role": "user", "content": "word " * 300}]
    with pytest.raises(ValueError, match="exceeds max_context_length"):
        mgr.chat("s", huge, max_new_tokens=MAX_NEW)


class _CountingTokenizer:
    """The tiny tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tokenizer):
        self._tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, *args, **kwargs):
        self.longest = max(self.longest, len(text))
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("overflow", ["error", "truncate"])
def test_a_prompt_too_long_to_fit_is_never_tokenized(llama, tokenizer, overflow):
    """A message of megabytes against a 200-token context: refused (or, with
    truncation, dropped) from its length alone, without tokenizing it, and
    the session is left as it was."""
    from kvchat.prompting import max_prompt_chars

    counting = _CountingTokenizer(tokenizer)
    mgr = SessionManager(llama, counting, max_context_length=LIMIT, overflow=overflow)
    huge = "word " * (max_prompt_chars(tokenizer, LIMIT) // 5 + 1000)
    messages = [SYSTEM, {"role": "user", "content": huge}]
    with pytest.raises(ValueError, match=rf"prompt of \d+ characters .*exceeds.*={LIMIT}"):
        mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert counting.longest < len(huge), "the overlong prompt was tokenized"
    assert mgr.sessions() == []
    if overflow == "truncate":  # an old overlong turn is dropped before it is tokenized
        old = [SYSTEM, {"role": "user", "content": huge}, {"role": "assistant", "content": "Ok."}]
        reply = mgr.chat("s", [*old, user_message(1)], max_new_tokens=MAX_NEW)
        assert counting.longest < len(huge)
        kept = [SYSTEM, user_message(1)]
        assert reply == reference_turn(llama, tokenizer, kept)[0]
