"""Prompts of turns that start together (engine/prompts.py), in float64: on a
full-attention model several prompts prefill in one forward, right-padded
(new conversations whose prompts begin alike, as one sequence instead:
test_engine_heads.py), and a prefix one row holds is copied into another
rather than computed again; each reply is still its own plain ``generate``'s,
token for token. Where a layer keeps a window or a state (sliding window,
conv), each prompt runs alone, as before."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from helpers import model_for, reference_turn, user_message
from kvchat import SessionManager
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_model, tiny_tokenizer
from test_engine import chat_call, together, wait_for

LONG_SYSTEM = {
    "role": "system",
    "content": "You are the planning agent of a travel company. You can look up trains, "
    "flights and hotels, compare their prices, and book what the customer picks. Always "
    "say what you looked up and what it costs before you book anything.",
}


def own_system(k: int) -> list[dict]:
    """Conversation ``k``: a system prompt no other conversation starts with,
    and k + 1 user messages, so every prompt has its own length."""
    messages = [{"role": "system", "content": f"Assistant number {k}, be brief."}]
    return messages + [user_message(10 * k + j) for j in range(k + 1)]


def reply_and_next(tokenizer, messages, expected) -> list[dict]:
    reply = tokenizer.decode(expected, skip_special_tokens=True)
    return [*messages, {"role": "assistant", "content": reply}, user_message(7)]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize(
    ("family", "shares"), [("llama", True), ("qwen3", True), ("gemma3", False)]
)
def test_prompts_that_start_together_prefill_in_one_forward(family, shares, tokenizer):
    """Three prompts of different lengths, then three turns on caches of
    different lengths (a merged, left-padded past), each in one forward:
    every reply is plain generate's. gemma3's sliding-window layers keep
    only their window, so its prompts run alone."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    conversations = [own_system(k) for k in range(3)]
    for turn in range(2):
        before = manager.stats()
        budgets = [6, 9, 12]
        reports = together(
            manager,
            [chat_call(manager, f"s{k}", conversations[k], budgets[k]) for k in range(3)],
        )
        for k, report in enumerate(reports):
            expected = reference_turn(model, tokenizer, conversations[k], budgets[k])[2]
            assert report.output_ids == expected, (turn, k)
            assert (report.reused_tokens > 0) == (turn > 0)
            conversations[k] = reply_and_next(tokenizer, conversations[k], expected)
        stats = manager.stats()
        together_now = stats.prompts_prefilled_together - before.prompts_prefilled_together
        assert together_now == (3 if shares else 0), (turn, stats)
        assert stats.prefix_tokens_copied == 0  # nothing in common worth copying
    manager.close()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_prefix_one_row_computes_is_copied_into_the_others(family, tokenizer):
    """Three conversations that start together with one long system prompt:
    the first computes it, the other two copy its keys and values and prefill
    only their own messages, in one forward; every reply is plain generate's."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    conversations = [[LONG_SYSTEM, user_message(k)] for k in range(3)]
    reports = together(
        manager, [chat_call(manager, f"s{k}", conversations[k], 8) for k in range(3)]
    )
    for k, report in enumerate(reports):
        assert report.output_ids == reference_turn(model, tokenizer, conversations[k], 8)[2]
    prompts = [render_prompt(tokenizer, messages).tolist() for messages in conversations]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts[:2], strict=False)) if a != b)
    stats = manager.stats()
    assert shared > 40
    assert stats.prefix_tokens_copied >= 2 * (shared - 8), (shared, stats)
    assert stats.prompts_prefilled_together == 2, stats
    manager.close()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_decoding_row_lends_its_prompt_to_a_turn_that_joins(family, tokenizer):
    """A conversation decoding in the batch holds its prompt's keys and
    values: a new turn that starts with the same system prompt copies them,
    and both replies are plain generate's."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    first = [LONG_SYSTEM, user_message(0)]
    stream = manager.stream_chat("first", first, max_new_tokens=30)
    next(stream)
    second = [LONG_SYSTEM, user_message(1)]
    manager.chat("second", second, max_new_tokens=6)
    list(stream)
    assert manager.last_turn("first").output_ids == reference_turn(model, tokenizer, first, 30)[2]
    assert manager.last_turn("second").output_ids == reference_turn(model, tokenizer, second, 6)[2]
    assert manager.stats().prefix_tokens_copied > 40
    manager.close()


def test_a_failing_reply_in_a_shared_forward_fails_only_its_turn(tokenizer):
    """Two prompts in one forward; one turn's streamer raises on its first
    token. That turn fails with its error, the other's reply is plain
    generate's, and the failed session takes a next turn exactly."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)

    class Broken:
        def put(self, value):
            raise ValueError("the client went away")

        def end(self):
            pass

    conversations = [own_system(0), own_system(1)]
    prompt = render_prompt(tokenizer, conversations[0])[None]
    errors = []

    def broken():
        try:
            manager.generate(prompt, session_id="broken", max_new_tokens=5, streamer=Broken())
        except ValueError as error:
            errors.append(error)

    threads = [
        threading.Thread(target=broken),
        threading.Thread(target=chat_call(manager, "fine", conversations[1], 6)),
    ]
    with manager._engine.hold():
        for i, thread in enumerate(threads):
            thread.start()
            wait_for(lambda i=i: manager.stats().queued > i, f"turn {i} queued")
    for thread in threads:
        thread.join()
    assert [str(e) for e in errors] == ["the client went away"]
    assert manager.stats().prompts_prefilled_together == 2
    assert (
        manager.last_turn("fine").output_ids
        == reference_turn(model, tokenizer, conversations[1], 6)[2]
    )
    again = manager.chat("broken", conversations[0], max_new_tokens=4)
    assert (
        manager.last_turn("broken").output_ids
        == reference_turn(model, tokenizer, conversations[0], 4)[2]
    )
    assert again
    manager.close()


def test_a_waiting_prompt_gathers_with_a_turn_on_its_way(tokenizer, monkeypatch):
    """A turn that has begun (its prompt being rendered, its session planned)
    but not reached the engine is expected: a prompt already waiting holds
    its forward for it (here without a time limit), and both prefill in one
    forward; the replies are plain generate's."""
    from kvchat.engine import loop

    monkeypatch.setattr(loop, "GATHER_S", 300.0)  # only the arrival ends the wait
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    first, second = own_system(0), own_system(1)
    thread = threading.Thread(target=chat_call(manager, "first", first, 6))
    with manager._engine.expect():  # the second turn has begun
        thread.start()
        wait_for(lambda: manager.stats().gather_waits > 0, "the first prompt waiting")
        manager.chat("second", second, max_new_tokens=6, settle=False)
    thread.join()
    stats = manager.stats()
    assert stats.prompts_prefilled_together == 2, stats
    assert manager._engine._loop.expected == 0
    for session, messages in (("first", first), ("second", second)):
        expected = reference_turn(model, tokenizer, messages, 6)[2]
        assert manager.last_turn(session).output_ids == expected
    manager.close()


def _arrive_now(loop, call) -> threading.Thread:
    """Runs ``call`` (a turn) on a thread and returns once its prompt is
    submitted: called from a decoding row's processor, it arrives during
    that step."""
    thread = threading.Thread(target=call)
    thread.start()
    wait_for(lambda: len(loop.incoming) == 1, "the prompt submitted")
    return thread


def _decode_first(manager, processor, tokens: int) -> None:
    """Session "first" decodes ``tokens`` tokens, ``processor`` called at each."""
    manager.chat(
        "first",
        own_system(0),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        logits_processor=[processor],
        settle=False,
    )


def test_a_prompt_that_arrives_during_a_step_joins_the_one_waiting(tokenizer):
    """Two prompts waiting when the prefill between two steps starts run in
    one forward, also the one that arrived during the step (after the loop
    took in the first): none prefills alone while the other waits a step
    and a forward more. Found in ``kvchat serve``'s traces: four
    conversations whose turns arrived within 45 ms prefilled two and two.
    A decoding row's processor holds each step until the next prompt is
    submitted, so the arrivals fall where they did there; both replies
    are plain generate's."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    loop = manager._engine._loop
    second, third = own_system(1), own_system(2)
    started = {}

    def hold_step(input_ids, scores):  # on the engine's thread, inside the step
        if "second" not in started:
            started["second"] = _arrive_now(loop, chat_call(manager, "second", second, 5))
        elif "third" not in started and loop.prefilling:  # the loop took the second in
            started["third"] = _arrive_now(loop, chat_call(manager, "third", third, 5))
        return scores

    _decode_first(manager, hold_step, 12)
    for thread in started.values():
        thread.join()
    assert sorted(started) == ["second", "third"]
    assert manager.stats().prompts_prefilled_together == 2
    for session, messages in (("second", second), ("third", third)):
        expected = reference_turn(model, tokenizer, messages, 5)[2]
        assert manager.last_turn(session).output_ids == expected
    manager.close()


def test_a_prompt_that_arrives_during_a_step_prefills_before_the_next(tokenizer):
    """A prompt submitted during a decode step, with none other waiting,
    prefills right after that step: its first token comes before the
    decoding row's next step, not one step later."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    loop = manager._engine._loop
    steps, seen = [], {}

    def count_steps(input_ids, scores):  # the decoding row's processor, once per step
        steps.append(len(steps))
        if len(steps) == 2:
            second = functools.partial(
                manager.chat,
                "second",
                own_system(1),
                max_new_tokens=3,
                logits_processor=[first_pick],
                settle=False,
            )
            seen["thread"] = _arrive_now(loop, second)
        return scores

    def first_pick(input_ids, scores):
        seen.setdefault("steps", len(steps))
        return scores

    _decode_first(manager, count_steps, 8)
    seen["thread"].join()
    # The first row's processor had run for its prefill's token and for the
    # step the second prompt arrived in, no more: the second prefilled next.
    assert seen["steps"] == 2
    expected = reference_turn(model, tokenizer, own_system(1), 3)[2]
    assert manager.last_turn("second").output_ids == expected
    manager.close()


def test_a_turn_that_never_arrives_delays_a_prompt_once(tokenizer):
    """A turn expected but never submitted (here: one that stays begun) holds
    a waiting prompt back only GATHER_S; the prompt then runs, exactly."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    begun, done = threading.Event(), threading.Event()

    def never_arrives():  # a turn begun on another thread that stays begun
        with manager._engine.expect():
            begun.set()
            done.wait()

    stuck = threading.Thread(target=never_arrives)
    stuck.start()
    begun.wait()
    try:
        reply = chat_call(manager, "alone", own_system(0), 5)()
    finally:
        done.set()
        stuck.join()
    assert reply.output_ids == reference_turn(model, tokenizer, own_system(0), 5)[2]
    assert manager.stats().gather_waits > 0
    assert manager._engine._loop.expected == 0
    manager.close()


def test_every_kind_of_turn_stops_being_expected(tokenizer):
    """Turns that run alone (plain generate), that fail before reaching the
    engine, that run inside another turn's thread, and batched ones: none
    is left expected, so no later prompt waits for a turn that is gone."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    loop = manager._engine._loop
    manager.chat("a", own_system(0), max_new_tokens=3)
    assert loop.expected == 0
    manager.chat("b", own_system(1), max_new_tokens=3, num_beams=2)  # plain generate
    assert loop.expected == 0
    with pytest.raises(ValueError):
        manager.chat("c", own_system(0), max_new_tokens=-1)
    assert loop.expected == 0
    with manager._engine.expect():  # a turn begun inside another's thread
        manager.chat("d", own_system(2), max_new_tokens=3)
        assert loop.expected == 0  # its own submission cleared the one announcement
    assert loop.expected == 0
    stream = manager.stream_chat("e", own_system(0), max_new_tokens=3)
    list(stream)
    assert loop.expected == 0
    # One conversation at a time: no prompt ever waited for its own turn.
    assert manager.stats().gather_waits == 0
    manager.close()


@pytest.mark.parametrize(
    ("options", "copying"),
    [
        ({}, {"t1/c": True, "t2/b": True}),
        ({"isolate_namespaces": True}, {"t1/c": True, "t2/b": False}),
        ({"share_prefixes": False}, {"t1/c": False, "t2/b": False}),
    ],
    ids=["shared", "namespaces", "off"],
)
def test_a_prefix_is_copied_only_where_the_manager_shares_prefixes(options, copying, tokenizer):
    """The engine's prefix copy keeps the manager's sharing rules: with
    isolate_namespaces a tenant's prompt never starts from another tenant's
    keys and values, and share_prefixes=False copies nothing. Every reply is
    plain generate's either way."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, **options)
    sessions = ["t1/a", "t2/b", "t1/c"]
    conversations = {s: [LONG_SYSTEM, user_message(k)] for k, s in enumerate(sessions)}
    together(manager, [chat_call(manager, s, conversations[s], 5) for s in sessions])
    for s in sessions:
        expected = reference_turn(model, tokenizer, conversations[s], 5)[2]
        assert manager.last_turn(s).output_ids == expected, s
    prompts = {s: render_prompt(tokenizer, conversations[s]).tolist() for s in sessions}

    def common(a, b):
        return next(
            i for i, (x, y) in enumerate(zip(prompts[a], prompts[b], strict=False)) if x != y
        )

    # A copying row takes the longest prefix a row before it (that it may
    # copy from) holds: t2/b from t1/a, t1/c from t1/a (or t2/b, if shared).
    best_for_c = common("t1/a", "t1/c")
    if "isolate_namespaces" not in options:
        best_for_c = max(best_for_c, common("t2/b", "t1/c"))
    expected = copying["t2/b"] * common("t1/a", "t2/b") + copying["t1/c"] * best_for_c
    assert manager.stats().prefix_tokens_copied == expected, (copying, expected)
    manager.close()


def test_a_rope_that_follows_the_longest_position_never_batches(tokenizer):
    """Dynamic NTK rotary embeddings pick their frequencies from the longest
    position in a forward, so rows decoding or prefilling together would
    change each other's: such a model's turns run alone, and stay exact."""
    model = tiny_model(
        "llama",
        dtype=torch.float64,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    manager = SessionManager(model, tokenizer)
    conversations = [own_system(k) for k in range(2)]
    reports = {}
    threads = [
        threading.Thread(
            target=lambda k=k: reports.update(
                {k: chat_call(manager, f"s{k}", conversations[k], 6)()}
            )
        )
        for k in range(2)
    ]
    for thread in threads:  # at once; each runs alone on the engine's thread
        thread.start()
    for thread in threads:
        thread.join()
    for k in range(2):
        assert reports[k].output_ids == reference_turn(model, tokenizer, conversations[k], 6)[2]
    stats = manager.stats()
    assert stats.decode_steps == 0 and stats.jobs_run_alone >= 2, stats
    manager.close()


def test_a_gathering_prompt_goes_on_when_the_expected_turn_ends_elsewhere(tokenizer, monkeypatch):
    """A turn that was expected but ends without reaching the engine (an
    error before its row) releases the prompt that waits for it at once,
    not after the gather's time (here unbounded)."""
    from kvchat.engine import loop

    monkeypatch.setattr(loop, "GATHER_S", 1e9)
    model = model_for("llama")
    manager = SessionManager(model, tokenizer)
    release = threading.Event()

    def fails_before_its_row():
        try:
            with manager._engine.expect(""):
                release.wait()
                raise ValueError("a bad request, found late")
        except ValueError:
            pass

    other = threading.Thread(target=fails_before_its_row)
    other.start()
    waiting = threading.Thread(target=chat_call(manager, "waiting", own_system(0), 4))
    waiting.start()
    wait_for(lambda: manager.stats().gather_waits > 0, "the prompt gathering")
    release.set()
    other.join()
    waiting.join()  # without the wake-up it would wait for ever
    expected = reference_turn(model, tokenizer, own_system(0), 4)[2]
    assert manager.last_turn("waiting").output_ids == expected
    manager.close()


def _first_turns_together(manager, tokenizer, sessions, system):
    conversations = {s: [system, user_message(k)] for k, s in enumerate(sessions)}
    together(manager, [chat_call(manager, s, conversations[s], 6) for s in sessions])
    return conversations


@pytest.mark.parametrize(
    "family",
    ["lfm2", "qwen3_5", pytest.param("falcon_h1", marks=pytest.mark.slow), "nemotron_h"],
)
def test_hybrid_rows_copy_a_prefix_up_to_a_checkpoint(family, tokenizer):
    """Conv, DeltaNet or Mamba2 layers beside attention: three conversations
    start together with one long system prompt. The first stops its prefill
    at its checkpoint there (LFM2 would read it off its one forward's conv
    windows, which nobody else could use before its turn ends); the other
    two copy the attention columns up to it from its cache and the other
    layers' states from the checkpoint, take their own checkpoint there, and
    prefill only their own message. Every reply is plain generate's, and an
    edit right after the system prompt restores each session's own
    checkpoint, exactly."""
    from helpers import LONG_SYSTEM as HYBRID_SYSTEM

    model = model_for(family)
    manager = SessionManager(model, tokenizer)
    sessions = ["a", "b", "c"]
    conversations = _first_turns_together(manager, tokenizer, sessions, HYBRID_SYSTEM)
    for s in sessions:
        expected = reference_turn(model, tokenizer, conversations[s], 6)[2]
        assert manager.last_turn(s).output_ids == expected, s
    stats = manager.stats()
    # The first row: two forwards (to its checkpoint, then on); the others one each.
    assert stats.prefill_chunks == 4, stats
    for s in sessions:
        edited = [HYBRID_SYSTEM, user_message(40)]
        reply = manager.chat(s, edited, max_new_tokens=6, settle=False)
        assert reply == reference_turn(model, tokenizer, edited, 6)[0], s
        report = manager.last_turn(s)
        assert report.checkpoint_restored == report.reused_tokens > 200, (s, report)
    assert stats.prefix_tokens_copied == 2 * report.checkpoint_restored, stats
    manager.close()


@pytest.mark.parametrize(
    ("options", "copied"),
    [({}, True), ({"isolate_namespaces": True}, False), ({"share_prefixes": False}, False)],
    ids=["shared", "namespaces", "off"],
)
def test_a_hybrid_prefix_copy_keeps_the_sharing_rules(options, copied, tokenizer):
    """LFM2: a row copies another's checkpoint only where the manager lets
    sessions share prefixes (then the second prefills its own message alone,
    in one forward); where none may, each computes the system prompt."""
    from helpers import LONG_SYSTEM as HYBRID_SYSTEM

    model = model_for("lfm2")
    manager = SessionManager(model, tokenizer, **options)
    sessions = ["t1/a", "t2/b"]
    conversations = _first_turns_together(manager, tokenizer, sessions, HYBRID_SYSTEM)
    for s in sessions:
        expected = reference_turn(model, tokenizer, conversations[s], 6)[2]
        assert manager.last_turn(s).output_ids == expected, s
    stats = manager.stats()
    assert (stats.prefix_tokens_copied > 200) == copied, stats
    assert (stats.prefix_tokens_copied == 0) == (not copied), stats
    if copied:
        assert stats.prefill_chunks == 3, stats
    manager.close()
