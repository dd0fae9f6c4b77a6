"""The turn pipeline: begin_turn, the model, finish_turn. A turn that fails in
the model's part leaves the session with its history and no cache, never half
a turn, and the next turn is exact again."""

from __future__ import annotations

import pytest
from helpers import LONG_SYSTEM, MAX_NEW, REUSE_FAMILIES, model_for, reference_turn, user_message
from kvchat import SessionManager
from transformers import StoppingCriteria


class Explode(StoppingCriteria):
    """Raises after `after` decoding steps: the cache is half-written by then."""

    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("generate failed mid-turn")
        return False


def _two_turns(mgr, model, tokenizer):
    messages = [LONG_SYSTEM]
    for turn in range(2):
        messages.append(user_message(turn))
        reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
        messages.append({"role": "assistant", "content": reply})
    return messages


@pytest.mark.parametrize("family", REUSE_FAMILIES)
@pytest.mark.parametrize("where", ["before decoding", "mid-decoding"])
def test_a_turn_that_raises_in_generate_leaves_history_and_no_cache(family, where, tokenizer):
    model = model_for(family)
    mgr = SessionManager(model, tokenizer)
    messages = _two_turns(mgr, model, tokenizer)
    history = mgr.messages("s")
    before = mgr.stats()
    failing = [*messages, user_message(2)]
    if where == "before decoding":
        original = model.generate

        def boom(*args, **kwargs):
            raise RuntimeError("generate failed before it began")

        model.generate = boom
        try:
            with pytest.raises(RuntimeError, match="before it began"):
                mgr.chat("s", failing, max_new_tokens=MAX_NEW)
        finally:
            model.generate = original
    else:
        with pytest.raises(RuntimeError, match="mid-turn"):
            mgr.chat("s", failing, max_new_tokens=MAX_NEW, stopping_criteria=[Explode(2)])

    # History as before the turn; no cache at all (checkpoints included), so
    # nothing half-written can be reused; the failed turn is not counted.
    assert mgr.messages("s") == history
    info = mgr.info("s")
    assert info.cached_tokens == 0 and info.checkpoints == 0
    after = mgr.stats()
    assert after.resident_bytes == 0
    assert after.requests == before.requests

    # The next turn prefills everything once and is exact again.
    want, _, _ = reference_turn(model, tokenizer, failing)
    assert mgr.chat("s", failing, max_new_tokens=MAX_NEW) == want
    assert mgr.last_turn("s").reason == "no_cache"
    failing += [{"role": "assistant", "content": want}, user_message(3)]
    want, _, _ = reference_turn(model, tokenizer, failing)
    assert mgr.chat("s", failing, max_new_tokens=MAX_NEW) == want
    assert mgr.last_turn("s").reused_tokens > 0
