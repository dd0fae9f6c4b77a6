"""Settling between turns (docs/settling.md): after a reply the session is
brought, in the background, to the ids its next prompt starts with, so that
turn prefills only its new messages, whatever the reply re-tokenizes to.

Replies here are raw (a random model's output, which mostly does not
re-tokenize as generated), every turn is checked token for token against
plain ``generate`` on the full conversation (float64), and the hard timings
are forced: a turn that arrives while its session settles, a turn of another
session while a settle waits, a settle that fails, a client that sends back
something else than predicted.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import (
    CHECKPOINT_FAMILIES,
    LONG_SYSTEM,
    MARGIN,
    MAX_NEW,
    SYSTEM,
    common_prefix,
    history_ids,
    model_for,
    plain_with_margin,
    reference_turn,
    user_message,
)
from kvchat import SessionManager, settling
from kvchat.prompting import render_prompt
from kvchat.tiny import THINK_OPENING_TEMPLATE, tiny_tokenizer
from test_engine import wait_for


def _fixed(tokenizer, history, prompt) -> int:
    """How many of ``prompt``'s ids its history fixes."""
    return common_prefix(history_ids(tokenizer, history), prompt)


def _checked(mgr, model, tokenizer, messages, session="s"):
    """One turn checked against plain generate; (reply, report)."""
    _, _, expected = reference_turn(model, tokenizer, messages)
    reply = mgr.chat(session, messages, max_new_tokens=MAX_NEW)
    report = mgr.last_turn(session)
    assert report.output_ids == expected
    return reply, report


@pytest.mark.slow
def test_every_family_prefills_only_the_new_message_once_settled(any_family, tokenizer):
    family, model = any_family
    mgr = SessionManager(model, tokenizer)
    messages, retokenized = [LONG_SYSTEM], 0
    for turn in range(6):
        messages.append(user_message(turn))
        prompt = render_prompt(tokenizer, messages)
        held = mgr.cached_ids("s") if turn else []
        reply, t = _checked(mgr, model, tokenizer, messages)
        if turn:
            fixed = _fixed(tokenizer, messages[:-1], prompt)
            assert t.reused_tokens == common_prefix(held, prompt) == fixed, (family, turn, t, fixed)
            assert t.reason == "extend", (family, turn, t)
        ids = render_prompt(tokenizer, [*messages, {"role": "assistant", "content": reply}])
        as_sent = ids[prompt.numel() :]
        retokenized += common_prefix(as_sent, t.output_ids) < len(t.output_ids) - 1
        messages.append({"role": "assistant", "content": reply})
        assert mgr.wait_settled(timeout=60)
    assert retokenized, "every reply re-tokenized as generated: the hard case was not run"
    stats = mgr.stats()
    assert stats.settles >= 5 and stats.settled_tokens > 0 and stats.settle_misses == 0


def test_without_settling_hybrids_fall_back_to_a_checkpoint(tokenizer):
    """The same conversation with settle=False: the next prompt departs inside
    the re-tokenized reply, and a hybrid reuses only up to a checkpoint there."""
    model = model_for("lfm2")
    mgr = SessionManager(model, tokenizer, settle=False)
    messages, short = [LONG_SYSTEM], 0
    for turn in range(4):
        messages.append(user_message(turn))
        prompt = render_prompt(tokenizer, messages)
        reply, t = _checked(mgr, model, tokenizer, messages)
        if turn:
            short += t.reused_tokens < _fixed(tokenizer, messages[:-1], prompt)
        messages.append({"role": "assistant", "content": reply})
    assert short > 0
    assert mgr.stats().settles == 0


def _slow_settle(mgr, entered: threading.Event, release: threading.Event):
    """Makes each settle forward wait for ``release`` (the first sets ``entered``)."""
    prefill = mgr._settler._prefill
    forward = prefill.forward

    def waiting(*args, **kwargs):
        if threading.current_thread().name == "kvchat-engine":  # settles run there
            entered.set()
            release.wait(30)
        return forward(*args, **kwargs)

    prefill.forward = waiting


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_a_turn_on_a_settling_session_takes_over(family, tokenizer):
    """The turn waits for the chunk in progress, takes what was prefilled and
    prefills the rest itself; output unchanged."""
    model = model_for(family)
    mgr = SessionManager(model, tokenizer)
    # Test-only: one token per chunk, never resized, so the turn lands part way.
    mgr._settler._adapt = lambda tokens, seconds: None
    mgr._settler._chunk = 1
    handovers = []
    take_over = mgr._settler.take_over

    def recording(lease, prompt, box):
        if box:
            plan, _, settled, _ = box[0]
            handovers.append((plan.kept_tokens, settled, plan.target_tokens))
        return take_over(lease, prompt, box)

    mgr._settler.take_over = recording
    messages = [SYSTEM, user_message(0)]
    reply, _ = _checked(mgr, model, tokenizer, messages)
    mgr.wait_settled(timeout=60)
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    entered, release = threading.Event(), threading.Event()
    _slow_settle(mgr, entered, release)
    reply, _ = _checked(mgr, model, tokenizer, messages)  # schedules the settle
    assert entered.wait(30)
    messages += [{"role": "assistant", "content": reply}, user_message(2)]
    prompt = render_prompt(tokenizer, messages)
    timer = threading.Timer(0.2, release.set)  # the chunk in progress ends meanwhile
    timer.start()
    _, t = _checked(mgr, model, tokenizer, messages)
    timer.join()
    assert mgr.stats().settles_taken_over == 1, mgr.stats()
    [(kept, settled, target)] = handovers
    assert kept < settled < target  # part way: one chunk of one token
    # The turn started from what the settle prefilled, and prefilled the rest.
    assert t.reused_tokens == settled
    assert t.prefilled_tokens == prompt.numel() - settled
    assert mgr.wait_settled(timeout=60)


def _record_settle_forwards(mgr) -> list:
    """The settle forwards ``mgr`` runs from now on (each a thread name)."""
    ran = []
    forward = mgr._settler._prefill.forward

    def recording(*args, **kwargs):
        ran.append(threading.current_thread().name)
        return forward(*args, **kwargs)

    mgr._settler._prefill.forward = recording
    return ran


def _hold_a_turn_of_b(mgr, **kwargs) -> tuple[threading.Event, threading.Thread]:
    """Starts a turn of session "b" and returns once it runs, held open by a
    logits processor until the returned event is set; and its thread."""
    started, finish = threading.Event(), threading.Event()

    def hold(input_ids, scores):
        started.set()
        finish.wait(30)
        return scores

    other = threading.Thread(
        target=mgr.chat,
        args=("b", [SYSTEM, user_message(5)]),
        kwargs=dict(max_new_tokens=2, logits_processor=[hold], **kwargs),
    )
    other.start()
    assert started.wait(30)
    return finish, other


def test_settling_waits_while_any_turn_runs(tokenizer):
    """A settle of one session never runs beside a turn of another."""
    model = model_for("llama")
    mgr = SessionManager(model, tokenizer)
    first = [SYSTEM, user_message(0)]
    reply = mgr.chat("a", first, max_new_tokens=MAX_NEW)
    mgr.wait_settled(timeout=60)
    ran = _record_settle_forwards(mgr)
    finish, other = _hold_a_turn_of_b(mgr)
    mgr.settle("a", [*first, {"role": "assistant", "content": reply + " Edited."}])
    assert not mgr.wait_settled(timeout=0.5)  # waits for b's turn
    assert ran == []
    finish.set()
    other.join()
    assert mgr.wait_settled(timeout=60)
    assert "kvchat-engine" in ran  # the engine runs every forward


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_a_turn_sent_at_once_drops_the_settle_and_prefills_its_ids(family, tokenizer):
    """A next turn that comes before settle_delay (an agent with a quick tool)
    finds no settle started: none waits for a settle's forward, and the turn
    prefills from what the session held, in its own forward, exactly. Found
    in kvchat serve's traces: the settle started as the turn ended and the
    next turn, 20 to 35 ms later, waited 50 to 70 ms for its forward."""
    model = model_for(family)
    mgr = SessionManager(model, tokenizer, settle_delay=30.0)  # far longer than this test
    ran = _record_settle_forwards(mgr)
    messages = [SYSTEM, user_message(0)]
    reply, _ = _checked(mgr, model, tokenizer, messages)
    held = mgr.cached_ids("s")
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    prompt = render_prompt(tokenizer, messages)
    _, t = _checked(mgr, model, tokenizer, messages)
    assert ran == []
    stats = mgr.stats()
    assert stats.settles == 0 and stats.settles_taken_over == 0, stats
    assert t.reused_tokens <= common_prefix(held, prompt)
    assert t.prefilled_tokens == prompt.numel() - t.reused_tokens
    # Its own settle waits too; wait_settled starts it at once.
    assert mgr.wait_settled(timeout=60)
    assert ran and mgr.stats().settles == 1
    mgr.close()


def test_wait_settled_does_not_wait_out_the_delay(tokenizer):
    """wait_settled() starts waiting settles at once; the next turn then
    prefills only its new message."""
    model = model_for("llama")
    mgr = SessionManager(model, tokenizer, settle_delay=300.0)
    messages = [SYSTEM, user_message(0)]
    reply, _ = _checked(mgr, model, tokenizer, messages)
    assert mgr.wait_settled(timeout=60)  # long before 300 s
    assert mgr.stats().settles == 1
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    prompt = render_prompt(tokenizer, messages)
    _, t = _checked(mgr, model, tokenizer, messages)
    assert t.reused_tokens == _fixed(tokenizer, messages[:-1], prompt)
    mgr.close()


class _Clock:
    """settling.py's ``time``, whose ``monotonic`` moves only when a test moves
    it: a settle is due when the test says, however slow the machine."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):  # perf_counter and the rest: the real ones
        return getattr(time, name)


def test_the_delay_counts_from_the_last_turn_of_any_session(tokenizer, monkeypatch):
    """A settle waits settle_delay after the last turn of any session ended,
    not only after its own: a session whose turn ended long ago does not
    settle the moment another's turn ends, when that one's next turn may
    be on its way. Once the delay has passed from that end, it settles on
    its own (no wait_settled). On a clock the test moves, so no stall of a
    busy machine makes a settle due early."""
    clock = _Clock()
    monkeypatch.setattr(settling, "time", clock)
    model = model_for("llama")
    mgr = SessionManager(model, tokenizer, settle_delay=1.0)
    ran = _record_settle_forwards(mgr)

    def advance(seconds: float) -> None:
        clock.now += seconds
        with mgr._settler._cond:  # the settle thread waits on it, until the next one is due
            mgr._settler._cond.notify_all()

    mgr.chat("a", [SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)  # a's settle: due in 1 s
    finish, other = _hold_a_turn_of_b(mgr, settle=False)  # past a's own delay
    advance(1.5)  # a's own delay passes while b's turn runs
    finish.set()
    other.join()  # b's turn ends now
    advance(0.9)  # a's own delay long past, b's end not yet settle_delay ago
    time.sleep(0.3)  # real time for a settle that were due to reach its forward
    assert ran == [] and mgr.stats().settles == 0
    advance(0.2)  # settle_delay after b's end: a settles, unasked
    wait_for(lambda: mgr.stats().settles == 1, "a's settle")
    assert "kvchat-engine" in ran
    mgr.close()


def test_a_settle_delay_longer_than_a_lock_can_wait_still_settles(tokenizer):
    """Any finite settle_delay is taken (1e10 s: settle only on wait_settled),
    longer than a lock can wait (threading.TIMEOUT_MAX, about 292 years).
    The settle thread waited out the delay in one wait, whose OverflowError
    killed it: no settle ever ran again and wait_settled() hung. The same
    for a wait_settled timeout that long."""
    model = model_for("llama")
    mgr = SessionManager(model, tokenizer, settle_delay=1e10)
    ran = _record_settle_forwards(mgr)
    messages = [SYSTEM, user_message(0)]
    reply, _ = _checked(mgr, model, tokenizer, messages)
    # Lets the settle thread reach its wait for the delay (else wait_settled
    # below starts the settle first, and this checks less, never wrongly).
    time.sleep(0.3)
    assert ran == []
    assert mgr.wait_settled(timeout=60)
    assert ran and mgr.stats().settles == 1
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    _checked(mgr, model, tokenizer, messages)
    assert mgr.wait_settled(timeout=1e10)
    assert mgr.stats().settles == 2
    mgr.close()


def test_a_turn_while_a_settle_renders_its_target_defers_its_forward(tokenizer):
    """The delay also holds for a turn that runs after a settle started, while
    its target renders on the settle thread (a long conversation's template):
    the settle's first forward waits settle_delay after that turn ended, as a
    later chunk's does, rather than running the moment the engine is free,
    where that client's next turn, sent at once, would wait for it. Most
    settles are a single chunk, so none waited at all. (A margin of 0.5 s:
    a check that nothing ran yet.)"""
    model = model_for("llama")
    mgr = SessionManager(model, tokenizer, settle_delay=0.0)  # a's settle starts at once
    settler = mgr._settler
    ran = _record_settle_forwards(mgr)
    other = [SYSTEM, user_message(5)]
    rendered, schedule = threading.Event(), settler.schedule

    def scheduling(session_id, target, version):
        assert callable(target)  # rendered on the settle thread

        def render():
            settler._delay = 30.0  # from here on, far longer than this test
            turn = threading.Thread(
                target=mgr.chat,
                args=("b", other),
                kwargs=dict(max_new_tokens=MAX_NEW, settle=False),
            )
            turn.start()
            turn.join()
            rendered.set()
            return target()

        schedule(session_id, render, version)

    settler.schedule = scheduling
    _checked(mgr, model, tokenizer, [SYSTEM, user_message(0)], session="a")
    assert rendered.wait(60)
    time.sleep(0.5)
    assert ran == []
    assert mgr.last_turn("b").output_ids == reference_turn(model, tokenizer, other)[2]
    assert mgr.wait_settled(timeout=60)
    assert ran and mgr.stats().settles == 1
    mgr.close()


def test_a_client_that_sends_back_something_else_misses_and_stays_exact(any_family, tokenizer):
    family, model = any_family
    mgr = SessionManager(model, tokenizer)
    messages = [LONG_SYSTEM, user_message(0)]
    reply, first = _checked(mgr, model, tokenizer, messages)
    mgr.wait_settled(timeout=60)
    # The user edits the reply before going on.
    messages += [{"role": "assistant", "content": "Edited: " + reply}, user_message(1)]
    prompt = render_prompt(tokenizer, messages)
    held = mgr.cached_ids("s")  # the settled history
    _, t = _checked(mgr, model, tokenizer, messages)
    assert mgr.stats().settle_misses == 1
    # The previous prompt's end (a checkpoint on a hybrid) is reused still:
    # all of the common prefix but what the edit's first token merged with.
    lcp = common_prefix(held, prompt)
    assert first.prompt_tokens - 1 <= t.reused_tokens <= lcp
    assert t.reused_tokens >= 0.99 * lcp, (family, t, lcp)


def test_a_failed_settle_leaves_the_cache_it_started_from(tokenizer):
    model = model_for("lfm2")
    mgr = SessionManager(model, tokenizer)
    messages = [LONG_SYSTEM, user_message(0)]
    reply, first = _checked(mgr, model, tokenizer, messages)
    mgr.wait_settled(timeout=60)
    held = mgr.cached_ids("s")
    forward = mgr._settler._prefill.forward

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    mgr._settler._prefill.forward = failing
    mgr.settle("s", [*messages, {"role": "assistant", "content": reply + " (edited)"}])
    assert mgr.wait_settled(timeout=60)
    assert mgr.cached_ids("s") == held
    mgr._settler._prefill.forward = forward
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    _, t = _checked(mgr, model, tokenizer, messages)
    assert t.reused_tokens >= first.prompt_tokens - 1


def test_settle_names_bad_arguments(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer)
    with pytest.raises(KeyError):
        mgr.settle("nobody", [SYSTEM, user_message(0)])
    mgr.chat("s", [SYSTEM, user_message(0)], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]"):
        mgr.settle("s", [{"role": "user", "content": 3}])
    with pytest.raises(TypeError, match="settle must be a bool"):
        mgr.chat("s", [SYSTEM, user_message(0)], max_new_tokens=2, settle="no")
    with pytest.raises(TypeError, match="settle must be a bool"):
        SessionManager(llama, tokenizer, settle=1)
    with pytest.raises(TypeError, match="tools must be a list"):
        mgr.settle("s", [SYSTEM, user_message(0)], tools="get_weather")


@pytest.mark.parametrize(
    ("timeout", "error", "match"),
    [
        ("1", TypeError, "timeout must be a number of seconds or None, got '1'"),
        (True, TypeError, "timeout must be a number of seconds or None, got True"),
        (-1, ValueError, "timeout must be a finite number of seconds >= 0, got -1"),
        (float("nan"), ValueError, "timeout must be a finite number of seconds >= 0, got nan"),
    ],
)
def test_wait_settled_names_a_bad_timeout(llama, tokenizer, timeout, error, match):
    """With a settle waiting (its delay far off) and with none: a timeout
    that is no number of seconds is refused by name, not a TypeError from
    the clock's arithmetic, lock's ValueError, or a wait of a second (True)."""
    mgr = SessionManager(llama, tokenizer, settle_delay=300.0)
    for session in ("nobody yet", "s"):
        if session == "s":
            mgr.chat("s", [SYSTEM, user_message(0)], max_new_tokens=MAX_NEW)
            assert mgr.stats().settles_pending == 1
        with pytest.raises(error, match=match):
            mgr.wait_settled(timeout=timeout)
    assert mgr.wait_settled(timeout=60)
    mgr.close()


class _BlockingCore:
    """The core, with begin_settle held until ``release`` is set."""

    def __init__(self, core, entered, release):
        self._core, self._entered, self._release = core, entered, release

    def begin_settle(self, *args):
        self._entered.set()
        self._release.wait(30)
        return self._core.begin_settle(*args)

    def __getattr__(self, name):
        return getattr(self._core, name)


def test_a_settle_never_makes_a_call_busy(tokenizer):
    """With busy="error", a call on a session the settler holds for a moment
    (planning or committing) waits for it instead of raising SessionBusy."""
    model = model_for("llama")
    mgr = SessionManager(model, tokenizer, busy="error")
    messages = [SYSTEM, user_message(0)]
    reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    mgr.wait_settled(timeout=60)
    entered, release = threading.Event(), threading.Event()
    mgr._settler._core = _BlockingCore(mgr._settler._core, entered, release)
    mgr.settle("s", [*messages, {"role": "assistant", "content": reply + " More."}])
    assert entered.wait(30)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    mgr.clear("s")  # would raise SessionBusy if it did not wait
    timer.join()
    assert mgr.info("s").cached_tokens == 0
    assert mgr.wait_settled(timeout=60)


def test_max_checkpoints_one_keeps_the_checkpoint_the_next_turn_needs(tokenizer):
    """A template that opens <think> in its generation prompt (Qwen3.5) makes
    the next prompt depart inside it. With max_checkpoints=1, thinning kept
    the prompt's end, which lies past that: nothing was reused. Now it keeps
    the one the next turn restores. Settling off, so the turn itself restores it."""
    model = model_for("lfm2")
    tokenizer = tiny_tokenizer(THINK_OPENING_TEMPLATE)
    mgr = SessionManager(model, tokenizer, max_checkpoints=1, settle=False)
    messages = [SYSTEM]
    for turn in range(3):
        messages.append(user_message(turn))
        held = mgr.cached_ids("s") if turn else []
        prompt = render_prompt(tokenizer, messages)
        reply, t = _checked(mgr, model, tokenizer, messages)
        if turn:
            assert t.reused_tokens == common_prefix(held, prompt) > 0, (turn, t)
        messages.append({"role": "assistant", "content": f"Let me see.</think>\n\n{reply}"})


def test_settled_sessions_save_and_load_exactly(tmp_path, tokenizer):
    model = model_for("bamba")
    mgr = SessionManager(model, tokenizer)
    messages = [LONG_SYSTEM, user_message(0)]
    reply, _ = _checked(mgr, model, tokenizer, messages)
    mgr.wait_settled(timeout=60)
    mgr.save("s", tmp_path / "s.safetensors")
    other = SessionManager(model, tokenizer)
    other.load(tmp_path / "s.safetensors")
    messages += [{"role": "assistant", "content": reply}, user_message(1)]
    prompt = render_prompt(tokenizer, messages)
    _, t = _checked(other, model, tokenizer, messages)
    assert t.reused_tokens == _fixed(tokenizer, messages[:-1], prompt)


def test_text_mode_and_generate_do_not_settle(llama, tokenizer):
    text = SessionManager(llama, tokenizer, match="text")
    text.chat("s", [SYSTEM, user_message(0)], max_new_tokens=4)
    ids = render_prompt(tokenizer, [SYSTEM, user_message(0)]).unsqueeze(0)
    mgr = SessionManager(llama, tokenizer)
    mgr.generate(ids, session_id="g", max_new_tokens=4, do_sample=False)
    for manager in (text, mgr):
        assert manager.wait_settled(timeout=10)
        assert manager.stats().settles == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["lfm2", "bamba"])
def test_settled_half_precision_turns_keep_clear_first_tokens(family, dtype, tokenizer):
    """bfloat16 and float16 promise what test_bfloat16.py says (a clear first
    token is plain generate's); settled, each turn also prefills only its new
    message."""
    from kvchat.tiny import tiny_model

    model = tiny_model(family, dtype=dtype, seed=0)
    mgr = SessionManager(model, tokenizer)
    messages, checked = [LONG_SYSTEM], 0
    for turn in range(5):
        messages.append(user_message(turn))
        prompt = render_prompt(tokenizer, messages)
        expected, margin = plain_with_margin(model, prompt)
        mgr.chat("s", messages, max_new_tokens=MAX_NEW)
        t = mgr.last_turn("s")
        if turn:
            assert t.reused_tokens == _fixed(tokenizer, messages[:-1], prompt), (turn, t)
            if margin > MARGIN:
                assert t.output_ids[0] == expected[0], (turn, margin)
                checked += 1
        else:
            assert t.output_ids == expected
        # The client sends back kvchat's reply, as a user would.
        reply = tokenizer.decode(t.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        assert mgr.wait_settled(timeout=60)
    assert checked >= 2, f"only {checked} turns had a clear first token"


def test_checkpoint_families_are_covered():
    assert "lfm2" in CHECKPOINT_FAMILIES and "bamba" in CHECKPOINT_FAMILIES


def test_a_session_evicted_since_its_turn_is_not_settled(tokenizer):
    """kvchat serve settles after the turn's lease is gone; if another turn
    evicted the session meanwhile, settling would prefill it all from nothing
    (and evict it again)."""
    model = model_for("llama")
    mgr = SessionManager(model, tokenizer, max_sessions=1)
    messages = [LONG_SYSTEM, user_message(0)]
    reply = mgr.chat("a", messages, max_new_tokens=MAX_NEW, settle=False)
    mgr.chat("b", [SYSTEM, user_message(1)], max_new_tokens=MAX_NEW)  # evicts a
    mgr.wait_settled(timeout=60)
    before = mgr.stats().settled_tokens
    mgr.settle("a", [*messages, {"role": "assistant", "content": reply}])
    assert mgr.wait_settled(timeout=60)
    assert mgr.stats().settled_tokens == before
    assert not mgr.info("a").resident


def test_settle_refuses_what_chat_would(llama, tokenizer):
    mgr = SessionManager(llama, tokenizer, max_context_length=300)
    messages = [SYSTEM, user_message(0)]
    reply = mgr.chat("s", messages, max_new_tokens=4, settle=False)
    history = [*messages, {"role": "assistant", "content": reply}]
    with pytest.raises(ValueError, match="messages.*max_context_length=300"):
        mgr.settle("s", [*history, {"role": "user", "content": "word " * 400}, history[-1]])
    alternating = tiny_tokenizer(
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == "
        "messages[loop.index0 - 1]['role'] %}{{ raise_exception('roles must alternate') }}"
        "{% endif %}{% endfor %}" + tokenizer.chat_template
    )
    strict = SessionManager(llama, alternating)
    strict.chat("s", messages, max_new_tokens=4, settle=False)
    with pytest.raises(ValueError, match="messages: the chat template refused them"):
        strict.settle("s", [*history, history[-1]])
    for manager in (mgr, strict):
        assert manager.wait_settled(timeout=60) and manager.stats().settles == 0


def test_an_interrupted_turn_does_not_stop_settling(tokenizer):
    """Ctrl-C while a turn waits for its session's settle: settling goes on
    for every session afterwards."""
    import _thread

    model = model_for("llama")
    mgr = SessionManager(model, tokenizer)
    entered, release = threading.Event(), threading.Event()
    _slow_settle(mgr, entered, release)
    messages = [LONG_SYSTEM, user_message(0)]
    reply = mgr.chat("s", messages, max_new_tokens=MAX_NEW)
    assert entered.wait(30)
    interrupt = threading.Timer(0.3, _thread.interrupt_main)
    interrupt.start()
    threading.Timer(0.6, release.set).start()
    with pytest.raises(KeyboardInterrupt):
        mgr.chat("s", [*messages, {"role": "assistant", "content": reply}, user_message(1)])
        time.sleep(5)  # the interrupt lands here if the turn was quicker
    mgr.chat("b", [SYSTEM, user_message(3)], max_new_tokens=MAX_NEW)
    assert mgr.wait_settled(timeout=30)
    assert mgr.stats().settles_pending == 0


def test_an_eviction_a_settle_causes_reaches_the_spill(tmp_path, tokenizer):
    model = model_for("llama")
    a = [LONG_SYSTEM, user_message(0)]
    b = [LONG_SYSTEM, {"role": "user", "content": "Something else entirely, about cats."}]

    # The budget's run loads b rather than running its turn: a turn's decode
    # batch counts in max_cache_bytes too, and would evict a before b settles.
    saved = tmp_path / "b.safetensors"

    def run(**options):
        mgr = SessionManager(model, tokenizer, share_prefixes=False, **options)
        reply = mgr.chat("a", a, max_new_tokens=MAX_NEW)
        mgr.wait_settled(timeout=60)
        if saved.exists():
            mgr.load(saved)
        else:
            mgr.chat("b", b, max_new_tokens=MAX_NEW, settle=False)
            mgr.save("b", saved)
        before = mgr.stats()
        mgr.settle("b", mgr.messages("b"))
        assert mgr.wait_settled(timeout=60)
        return mgr, reply, before

    probe, _, before = run()
    # A budget both sessions fit before b settles, and not after.
    budget = (before.resident_bytes + probe.stats().resident_bytes) // 2
    spill = tmp_path / "spill"
    mgr, reply, before = run(spill_dir=spill, max_cache_bytes=budget)
    assert before.evictions == 0 and mgr.stats().evictions == 1
    assert not mgr.info("a").resident
    # Written at once, not when some later turn happens to flush the queue.
    assert mgr.stats().spill_writes == 1 and len(list(spill.iterdir())) == 1
    messages = [*a, {"role": "assistant", "content": reply}, user_message(1)]
    _checked(mgr, model, tokenizer, messages)
