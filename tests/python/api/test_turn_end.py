"""``ReplyStream.end``: a streamed turn's end in one call. It waits for the
commit, waits for a shared store to write the session (``flush_timeout``),
and settles the session on what the caller sends back, rendered with the
turn's own tools and template arguments; what ``kvchat serve`` does at the
end of each request, as a library call."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import (
    LONG_SYSTEM,
    MAX_NEW,
    common_prefix,
    history_ids,
    model_for,
    reference_turn,
    user_message,
)
from kvchat import SessionManager, SharedTier
from kvchat.prompting import render_prompt
from transformers import StoppingCriteria

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _cut(reply: str) -> str:
    """The reply as a client that cut it (at a stop string, say) sends it
    back: its first half, so it cannot be the text the model's ids hold."""
    return reply[: max(1, len(reply) // 2)]


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_end_settles_each_session_on_what_its_caller_sends_back(family, tokenizer):
    """Two conversations streamed at once, one with tools; each stream ends
    with the reply cut short as its client keeps it. Each session is settled
    on that, with its turn's own tools, so its next turn reuses every id the
    history fixes, none of the raw reply, and answers as plain generate."""
    model = model_for(family)
    mgr = SessionManager(model, tokenizer)
    tools = {"a": TOOLS, "b": None}
    conversations = {sid: [LONG_SYSTEM, user_message(i)] for i, sid in enumerate("ab")}
    streams = {
        sid: mgr.stream_chat(sid, messages, max_new_tokens=MAX_NEW, tools=tools[sid], settle=False)
        for sid, messages in conversations.items()
    }
    replies = {sid: "".join(stream) for sid, stream in streams.items()}
    for sid, stream in streams.items():
        sent_back = [*conversations[sid], {"role": "assistant", "content": _cut(replies[sid])}]
        report = stream.end(sent_back)
        assert report is stream.report and report.generated_tokens > 0
        conversations[sid] = [*sent_back, user_message(5)]
    assert mgr.wait_settled(timeout=60)
    assert mgr.stats().settles == 2
    for sid, messages in conversations.items():
        prompt = render_prompt(tokenizer, messages, tools=tools[sid])
        fixed = common_prefix(history_ids(tokenizer, messages[:-1], tools[sid]), prompt)
        assert common_prefix(mgr.cached_ids(sid), prompt) == fixed, sid  # settled, exactly
        _, _, expected = reference_turn(model, tokenizer, messages, tools=tools[sid])
        mgr.chat(sid, messages, max_new_tokens=MAX_NEW, tools=tools[sid])
        turn = mgr.last_turn(sid)
        assert turn.output_ids == expected, sid
        assert turn.reused_tokens == fixed and turn.reason == "extend", (sid, turn, fixed)
    assert mgr.stats().settle_misses == 0


class _WritesWhenFlushed(SharedTier):
    """A shared store whose writer holds each turn's snapshot until someone
    waits for it (``flush``): only a flush gets the session stored."""

    def __init__(self):
        super().__init__()
        self.stored, self.flushes, self.writers = {}, [], {}
        self._flushing = threading.Event()

    def turn_finished(self, session_id, state, messages):
        writer = threading.Thread(target=self._write, args=(session_id, state), daemon=True)
        self.writers[session_id] = writer
        writer.start()

    def _write(self, session_id, state):
        self._flushing.wait()
        self.stored[session_id] = state

    def flush(self, timeout=None, session_id=None):
        self.flushes.append((timeout, session_id))
        self._flushing.set()
        writer = self.writers.get(session_id)
        if writer is not None:
            writer.join(timeout)
        return writer is None or not writer.is_alive()


def test_end_waits_for_the_store_to_write_the_session(llama, tokenizer):
    """``flush_timeout``: end returns once the store holds that session's
    snapshot of the turn, all its ids; without it (0, the default) end never
    waits for the store."""
    tier = _WritesWhenFlushed()
    mgr = SessionManager(llama, tokenizer, tier=tier)
    streams = {
        sid: mgr.stream_chat(sid, [LONG_SYSTEM, user_message(i)], settle=False)
        for i, sid in enumerate("ab")
    }
    replies = {sid: "".join(stream) for sid, stream in streams.items()}
    assert all(replies.values())
    streams["a"].end()
    assert tier.flushes == [] and tier.stored == {}
    report = streams["b"].end(flush_timeout=30)
    assert tier.flushes == [(30.0, "b")]
    stored = tier.stored["b"]  # written before end returned
    ids = torch.as_tensor(stored.ids).tolist()
    assert len(ids) == report.prompt_tokens + report.generated_tokens - 1
    assert ids == mgr.cached_ids("b")


class _Explode(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise RuntimeError("generate failed mid-turn")


def test_end_of_a_failed_or_removed_turn_settles_nothing(llama, tokenizer):
    """A turn that failed returns None and is not settled on (its error
    still raises from next()); a session removed before its turn ends is
    not settled either, and end does not raise for it."""
    mgr = SessionManager(llama, tokenizer)
    messages = [LONG_SYSTEM, user_message(0)]
    stream = mgr.stream_chat(
        "s", messages, max_new_tokens=MAX_NEW, settle=False, stopping_criteria=[_Explode()]
    )
    sent_back = [*messages, {"role": "assistant", "content": "Anything."}]
    assert stream.end(sent_back) is None
    with pytest.raises(RuntimeError, match="generate failed mid-turn"):
        "".join(stream)  # what it streamed before failing, then its error
    stream = mgr.stream_chat("t", messages, max_new_tokens=MAX_NEW, settle=False)
    "".join(stream)
    mgr.remove("t")
    assert stream.end(sent_back) is not None
    assert mgr.wait_settled(timeout=60)
    stats = mgr.stats()
    assert stats.settles == 0 and stats.settles_pending == 0
    assert mgr.sessions() == ["s"]


def test_end_names_a_bad_flush_timeout_and_leaves_the_turn_running(llama, tokenizer):
    """A ``flush_timeout`` that is no number of seconds >= 0 raises, naming
    it, before anything is done: the stream reads on to its end, and a
    later end() ends it."""
    mgr = SessionManager(llama, tokenizer)
    messages = [LONG_SYSTEM, user_message(0)]
    _, _, expected = reference_turn(llama, tokenizer, messages)
    stream = mgr.stream_chat("s", messages, max_new_tokens=MAX_NEW)
    for bad, error in [(-1, ValueError), (float("nan"), ValueError), ("5", TypeError)]:
        with pytest.raises(error, match="flush_timeout"):
            stream.end(flush_timeout=bad)
    reply = "".join(stream)
    report = stream.end()
    assert report.output_ids == expected
    assert reply == tokenizer.decode(torch.tensor(expected), skip_special_tokens=True)


def test_end_passes_on_what_settle_refuses_once_committed(llama, tokenizer):
    """``messages`` that settle() refuses (malformed, or a history that
    leaves no room for a next turn) raise as there, naming ``messages``,
    once the turn is committed: its report stands, its cache is the turn's,
    and nothing is settled."""
    mgr = SessionManager(llama, tokenizer, max_context_length=400)
    messages = [LONG_SYSTEM, user_message(0)]
    long = {"role": "assistant", "content": "word " * 400}
    for bad, error in [([{"role": "user"}], ValueError), ([*messages, long], ValueError)]:
        stream = mgr.stream_chat("s", messages, max_new_tokens=MAX_NEW, settle=False)
        reply = "".join(stream)
        with pytest.raises(error, match="messages"):
            stream.end(bad)
        report = stream.report
        assert report is not None and mgr.last_turn("s").output_ids == report.output_ids
        prompt = render_prompt(tokenizer, messages)
        assert mgr.cached_ids("s") == prompt.tolist() + list(report.output_ids[:-1])
        assert reply
    assert mgr.wait_settled(timeout=60)
    assert mgr.stats().settles == 0
