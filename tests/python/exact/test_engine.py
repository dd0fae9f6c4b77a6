"""Conversations decoding together in the engine's batch are each, token for
token, their own plain ``generate`` (float64, on the test device): rows of
different lengths, rows joining and leaving mid-decode, a row cancelled or
stopped by a stop string, a grammar-constrained row beside free ones, and a
seeded sampled row that gives the same tokens alone and batched.

``Engine.hold`` makes the turns start together: each test asserts, from
``stats()``, that its rows really shared decode steps."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import SYSTEM, model_for, reference_ids, reference_turn, user_message
from kvchat import SessionManager
from kvchat.agents.grammar import Grammars
from kvchat.prompting import end_ids, render_prompt
from kvchat.tiny import tiny_tokenizer

# The families: attention, sliding window, conv, DeltaNet, Mamba2
# beside attention, Mamba2 in its own layers with MLP-only ones.
FAMILIES = ["llama", "gemma3", "qwen3", "lfm2", "qwen3_5", "falcon_h1", "nemotron_h"]


def conversation(k: int) -> list[dict]:
    """Conversation ``k``: k + 1 user messages, so each is a different length."""
    messages = [SYSTEM]
    for turn in range(k + 1):
        messages.append(user_message(turn))
        if turn < k:
            messages.append({"role": "assistant", "content": f"Noted, part {turn}."})
    return messages


def wait_for(condition, what: str) -> None:
    """Polls ``condition``; a hang guard, not a timing assertion."""
    deadline = time.monotonic() + 300
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.002)


def together(manager, calls) -> list:
    """Runs each of ``calls`` on its own thread, their rows starting together."""
    results, errors = [None] * len(calls), []

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    with manager._engine.hold():
        for i, thread in enumerate(threads):  # queued (and so prefilled) in this order
            thread.start()
            wait_for(lambda i=i: manager.stats().queued + len(errors) > i, f"turn {i} queued")
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def chat_call(manager, session, messages, max_new_tokens, **kwargs):
    def call():
        # Not settled: a settle would move the cache before it is read below.
        manager.chat(session, messages, max_new_tokens=max_new_tokens, settle=False, **kwargs)
        report = manager.last_turn(session)
        # The session kept its cache: every token but the last one picked.
        held = manager.info(session).cached_tokens
        assert held == report.prompt_tokens + report.generated_tokens - 1, (session, held)
        return report

    return call


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def decode_rounds(manager, model, tokenizer, n, rounds=2, prefix="s") -> None:
    """``rounds`` turns (a first, then turns that reuse each cache) of ``n``
    conversations of different lengths decoding together, leaving one by
    one; each reply checked against plain generate."""
    conversations = [conversation(k) for k in range(n)]
    for _ in range(rounds):
        budgets = [10 + 2 * k for k in range(n)]  # they leave one by one
        reports = together(
            manager,
            [chat_call(manager, f"{prefix}{k}", conversations[k], budgets[k]) for k in range(n)],
        )
        for k, report in enumerate(reports):
            expected = reference_turn(model, tokenizer, conversations[k], budgets[k])[2]
            assert report.output_ids == expected, f"conversation {k} of {n}"
            reply = tokenizer.decode(expected, skip_special_tokens=True)
            conversations[k] = [
                *conversations[k],
                {"role": "assistant", "content": reply},
                user_message(7),
            ]


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("family", FAMILIES)
def test_conversations_of_different_lengths_decode_together_exactly(family, n, tokenizer):
    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    decode_rounds(manager, model, tokenizer, n)
    stats = manager.stats()
    assert stats.max_batch_rows == n, stats
    assert stats.reused_tokens > 0
    manager.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_join_and_leave_mid_decode(family, tokenizer):
    """A long reply streams while two shorter turns join its batch and leave it."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    long = conversation(0)
    stream = manager.stream_chat("long", long, max_new_tokens=40)
    pieces = [next(stream) for _ in range(3)]
    threads, reports = [], {}
    for k in (1, 2):
        call = chat_call(manager, f"s{k}", conversation(k), 5 + k)
        threads.append(threading.Thread(target=lambda k=k, call=call: reports.update({k: call()})))
        threads[-1].start()
    wait_for(lambda: len(reports) == 2, "the joining turns finish")
    pieces.extend(stream)
    for thread in threads:
        thread.join()
    assert manager.last_turn("long").output_ids == reference_turn(model, tokenizer, long, 40)[2]
    for k in (1, 2):
        expected = reference_turn(model, tokenizer, conversation(k), 5 + k)[2]
        assert reports[k].output_ids == expected
    assert manager.stats().max_batch_rows >= 2
    manager.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cancelled_row_leaves_the_others_exact(family, tokenizer):
    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    messages = conversation(0)
    with manager._engine.hold():
        stream = manager.stream_chat("cancelled", messages, max_new_tokens=40)
        others = [
            threading.Thread(target=chat_call(manager, f"s{k}", conversation(k), 12))
            for k in (1, 2)
        ]
        for thread in others:
            thread.start()
        wait_for(lambda: manager.stats().queued == 3, "every turn queued")
    wait_for(lambda: manager.stats().batch_rows == 3, "the three rows decoding together")
    next(stream)
    next(stream)
    stream.close()
    for thread in others:
        thread.join()
    expected = reference_turn(model, tokenizer, messages, 40)[2]
    got = manager.last_turn("cancelled").output_ids
    assert 2 <= len(got) < len(expected) and got == expected[: len(got)]
    for k in (1, 2):
        assert (
            manager.last_turn(f"s{k}").output_ids
            == reference_turn(model, tokenizer, conversation(k), 12)[2]
        )
    assert manager.stats().max_batch_rows == 3
    # The cancelled session is exact for its next turn.
    reply = tokenizer.decode(got, skip_special_tokens=True)
    after = [*messages, {"role": "assistant", "content": reply}, user_message(5)]
    manager.chat("cancelled", after, max_new_tokens=8)
    assert (
        manager.last_turn("cancelled").output_ids == reference_turn(model, tokenizer, after, 8)[2]
    )
    manager.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_strings_end_one_row(family, tokenizer):
    """One row's stop string matches its reply, another's never matches."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    first, second = conversation(0), conversation(1)
    reply = tokenizer.decode(reference_turn(model, tokenizer, first, 16)[2])
    stop = reply[len(reply) // 2 : len(reply) // 2 + 2]  # text the reply reaches midway
    assert stop.strip(), reply
    never = ["\u00a7never\u00a7"]
    reports = together(  # the row that stops early joins last, beside the others
        manager,
        [
            chat_call(manager, "c", conversation(2), 16),
            chat_call(manager, "b", second, 16, stop_strings=never, tokenizer=tokenizer),
            chat_call(manager, "a", first, 16, stop_strings=[stop], tokenizer=tokenizer),
        ],
    )[::-1]
    expected_a = reference_turn(
        model, tokenizer, first, 16, stop_strings=[stop], tokenizer=tokenizer
    )
    expected_b = reference_turn(
        model, tokenizer, second, 16, stop_strings=never, tokenizer=tokenizer
    )
    assert reports[0].output_ids == expected_a[2]
    assert len(expected_a[2]) < 16  # the stop string did end it
    assert reports[1].output_ids == expected_b[2]
    assert reports[2].output_ids == reference_turn(model, tokenizer, conversation(2), 16)[2]
    assert manager.stats().max_batch_rows == 3
    manager.close()


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def grammar_row_beside_free_ones(manager, model, tokenizer) -> None:
    """A JSON-schema-constrained row and two free ones decode together: each
    equals plain generate (the constrained one with a fresh processor of the
    same grammar), and the batch held all three."""
    grammars = Grammars(
        tokenizer, model.config.vocab_size, end_ids(tokenizer, model.generation_config)
    )
    grammar = grammars.json_schema(SCHEMA)
    processor = grammars.processor(grammar, "response_format")
    reports = together(
        manager,
        [
            chat_call(manager, "json", conversation(1), 30, logits_processor=[processor]),
            chat_call(manager, "a", conversation(0), 20),
            chat_call(manager, "b", conversation(2), 20),
        ],
    )
    fresh = grammars.processor(grammar, "response_format")
    expected = reference_turn(model, tokenizer, conversation(1), 30, logits_processor=[fresh])[2]
    assert reports[0].output_ids == expected
    assert tokenizer.decode(expected).startswith("{")
    for k, report in ((0, reports[1]), (2, reports[2])):
        assert report.output_ids == reference_turn(model, tokenizer, conversation(k), 20)[2]
    assert manager.stats().max_batch_rows == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_a_grammar_constrained_row_beside_free_ones(family, tokenizer):
    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    grammar_row_beside_free_ones(manager, model, tokenizer)
    manager.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_seeded_sampled_reply_is_the_same_alone_and_batched(family, tokenizer):
    model = model_for(family)
    sampling = dict(do_sample=True, temperature=0.9, top_p=0.95)
    messages = conversation(1)
    alone_manager = SessionManager(model, tokenizer)
    alone_manager.chat("s", messages, max_new_tokens=16, seed=1234, **sampling)
    alone = alone_manager.last_turn("s").output_ids
    alone_manager.close()
    manager = SessionManager(model, tokenizer)
    reports = together(
        manager,
        [
            chat_call(manager, "s", messages, 16, seed=1234, **sampling),
            chat_call(manager, "t", conversation(0), 16, seed=99, **sampling),
            chat_call(manager, "u", conversation(2), 16, **sampling),  # the global generator
            chat_call(manager, "v", conversation(3), 16),
        ],
    )
    assert reports[0].output_ids == alone
    assert manager.stats().max_batch_rows == 4
    # And it is plain generate's after torch.manual_seed(seed).
    prompt = render_prompt(tokenizer, messages)
    assert alone == reference_ids(model, prompt, 16, seed=1234, **sampling)
    manager.close()


def test_seed_is_checked_before_the_session_is_touched(tokenizer):
    manager = SessionManager(model_for("llama"), tokenizer)
    for bad in (1.5, True, "7", 2**64):
        with pytest.raises(ValueError, match=r"seed must be an int .*got"):
            manager.chat("s", conversation(0), max_new_tokens=2, seed=bad)
    assert "s" not in manager.sessions()
    manager.close()


def test_the_batch_buffers_are_freed_when_no_row_decodes(tokenizer):
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    together(manager, [chat_call(manager, f"s{k}", conversation(k), 6) for k in range(3)])
    stats = manager.stats()
    assert stats.batch_rows == 0 and stats.batch_bytes == 0 and stats.decode_steps > 0
    manager.close()


# Not LFM2: its checkpoints are read off one forward over the whole tail
# (bridge/windows.py), so that forward is never cut into chunks.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "lfm2"])
def test_a_long_prompt_prefills_in_chunks_while_others_decode(family, tokenizer):
    """With a row decoding, a new prompt is prefilled at most max_step_tokens
    tokens between two steps, stopping at a hybrid's checkpoints too; the
    chunks give plain generate's reply, and the decoding row goes on
    streaming meanwhile."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, max_step_tokens=16)
    stream = manager.stream_chat("decoding", conversation(0), max_new_tokens=60)
    next(stream)
    long = conversation(4)  # over a hundred tokens: several chunks
    before = manager.stats()
    manager.chat("long", long, max_new_tokens=8)
    report = manager.last_turn("long")
    stats = manager.stats()
    list(stream)
    assert report.output_ids == reference_turn(model, tokenizer, long, 8)[2]
    assert report.prompt_tokens > 64
    # What it computed (not what a full-attention model copied from the
    # decoding row's prompt, which it starts with) ran in chunks of 16.
    computed = report.prompt_tokens - (stats.prefix_tokens_copied - before.prefix_tokens_copied)
    assert stats.prefill_chunks - before.prefill_chunks >= computed // 16
    assert stats.jobs_run_alone == 0  # no checkpoint's prefill ran unchunked
    # The decoding row took a step between chunks.
    assert stats.decode_steps - before.decode_steps >= computed // 16
    assert (
        manager.last_turn("decoding").output_ids
        == reference_turn(model, tokenizer, conversation(0), 60)[2]
    )
    manager.close()


def test_a_turn_started_from_the_engines_thread_is_refused_by_name(tokenizer):
    """A streamer runs on the engine's thread; one that starts a turn there
    would wait for itself. It is refused at once, the turn it streams fails
    with that error, and the manager goes on."""
    from transformers.generation.streamers import BaseStreamer

    model = model_for("llama")
    manager = SessionManager(model, tokenizer)

    class CallsTheManager(BaseStreamer):
        def put(self, value):
            manager.chat("inner", conversation(0), max_new_tokens=2)

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="engine's own thread"):
        manager.chat("outer", conversation(1), max_new_tokens=4, streamer=CallsTheManager())
    assert "inner" not in manager.sessions()
    manager.chat("after", conversation(2), max_new_tokens=6)
    expected = reference_turn(model, tokenizer, conversation(2), 6)[2]
    assert manager.last_turn("after").output_ids == expected
    manager.close()


def test_no_engine_thread_starts_once_the_interpreter_exits(tokenizer, monkeypatch):
    """After atexit closed every engine, work handed over (a settle, a turn
    on a daemon thread) must not start a thread in the model while the
    interpreter tears it down: it is refused by name instead."""
    import threading as _threading

    from kvchat.engine import loop

    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    exiting = _threading.Event()
    exiting.set()
    monkeypatch.setattr(loop, "_EXITING", exiting)
    with pytest.raises(RuntimeError, match="interpreter is exiting"):
        manager.chat("s", [user_message(0)], max_new_tokens=2)
    assert manager._engine._loop.thread is None
    monkeypatch.setattr(loop, "_EXITING", _threading.Event())
    manager.chat("s", [user_message(0)], max_new_tokens=2)  # and the manager goes on
    manager.close()


def test_an_engine_restarted_after_close_is_closed_again_at_exit(tokenizer):
    """A turn after close() starts the engine's thread again: the atexit
    hook must close that one too, or the exit, which waits for every kvchat
    thread to end (daemon_threads.py), would wait for it forever."""
    from kvchat.engine import loop

    manager = SessionManager(model_for("llama"), tokenizer)
    manager.chat("s", [user_message(0)], max_new_tokens=2)
    manager.close()
    manager.chat("s", [user_message(0)], max_new_tokens=2)
    assert manager._engine._loop.thread is not None
    assert manager._engine._loop in loop._LIVE
    manager.close()
