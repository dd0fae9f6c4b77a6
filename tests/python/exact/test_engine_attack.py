"""The engine attacked as a stranger would: a row's processor or streamer
failing while others decode, streams closed or dropped at every stage, the
manager closed mid-turn or dropped, rows of very different lengths joining in
every order, the turns that run alone beside batched ones, per-row
generation options, eviction and prefix sharing while rows decode.

Every turn is checked against plain ``generate`` in float64 (greedy, or
sampled after ``torch.manual_seed``). Waits are hang guards (``wait_for``,
``joined``), not timing assertions."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from helpers import (
    LONG_SYSTEM,
    SYSTEM,
    common_prefix,
    exact_turn,
    model_for,
    reference_ids,
    reference_turn,
    user_message,
)
from kvchat import SessionManager
from kvchat.bridge import CacheBridge
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_tokenizer
from test_engine import chat_call, conversation, together, wait_for
from transformers import LogitsProcessor


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return model_for("llama")


def expected(model, tokenizer, messages, max_new_tokens, **kwargs):
    return reference_turn(model, tokenizer, messages, max_new_tokens, **kwargs)[2]


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """``fn()`` on a daemon thread; its result or error lands in the dict."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as error:  # noqa: BLE001 - inspected by the test
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def engine_alive(manager) -> bool:
    thread = manager._engine._loop.thread
    return thread is not None and thread.is_alive()


class RaiseAt(LogitsProcessor):
    """Raises on its ``at``-th call (1: the first token, picked after the prefill)."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"processor failed at call {self.at}")
        return scores


class Streamer:
    """A user's streamer: records tokens; ``put_fails_at`` (count of puts,
    the prompt's being the first) or ``end_fails`` make it raise."""

    def __init__(self, put_fails_at: int | None = None, end_fails: bool = False):
        self.puts, self.put_fails_at, self.end_fails = [], put_fails_at, end_fails
        self.ended = False

    def put(self, value):
        self.puts.append(value)
        if len(self.puts) == self.put_fails_at:
            raise RuntimeError(f"streamer put {self.put_fails_at} failed")

    def end(self):
        self.ended = True
        if self.end_fails:
            raise RuntimeError("streamer end failed")


# ---------------------------------------------------------------- one row fails


def _history_kept_then_exact(manager, model, tokenizer, session, first, before):
    """The session failed its second turn: it keeps its first turn's history
    (``before``), and its next turn is exact."""
    assert manager.messages(session) == before
    after = [*first, {"role": "assistant", "content": _reply(model, tokenizer, first)}]
    after.append(user_message(6))
    manager.chat(session, after, max_new_tokens=8)
    assert manager.last_turn(session).output_ids == expected(model, tokenizer, after, 8)


def _reply(model, tokenizer, messages, n=6):
    return tokenizer.decode(expected(model, tokenizer, messages, n), skip_special_tokens=True)


@pytest.mark.parametrize("at", [1, 4], ids=["first-token", "mid-decode"])
def test_a_failing_processor_fails_only_its_turn(at, model, tokenizer):
    """One row's logits processor raises (at its first token, picked after
    its prefill, or mid-decode) while two others decode: the others finish
    exactly, the failing turn raises in its caller, and its session keeps its
    history and is exact next turn."""
    manager = SessionManager(model, tokenizer)
    first = conversation(0)
    manager.chat("bad", first, max_new_tokens=6)
    before = manager.messages("bad")
    second = [*first, {"role": "assistant", "content": _reply(model, tokenizer, first)}]
    second.append(user_message(3))
    failing = RaiseAt(at)

    def bad():
        with pytest.raises(RuntimeError, match=f"processor failed at call {at}"):
            manager.chat("bad", second, max_new_tokens=12, logits_processor=[failing])
        return "raised"

    results = together(
        manager,
        [
            chat_call(manager, "a", conversation(1), 12),
            bad,
            chat_call(manager, "b", conversation(2), 12),
        ],
    )
    assert results[1] == "raised"
    for k, report in ((1, results[0]), (2, results[2])):
        assert report.output_ids == expected(model, tokenizer, conversation(k), 12)
    assert manager.stats().max_batch_rows >= 2
    _history_kept_then_exact(manager, model, tokenizer, "bad", second[:-2], before)
    assert engine_alive(manager)
    manager.close()


@pytest.mark.parametrize("at", [2, 5], ids=["first-token", "mid-decode"])
def test_a_failing_streamer_put_fails_only_its_turn(at, model, tokenizer):
    """A user's streamer raises in ``put`` (its first token's, put after the
    prefill, or a later one) while two others decode."""
    manager = SessionManager(model, tokenizer)
    streamer = Streamer(put_fails_at=at)

    def bad():
        with pytest.raises(RuntimeError, match="streamer put"):
            manager.chat("bad", conversation(3), max_new_tokens=12, streamer=streamer)
        return "raised"

    results = together(
        manager,
        [
            chat_call(manager, "a", conversation(1), 12),
            bad,
            chat_call(manager, "b", conversation(2), 12),
        ],
    )
    assert results[1] == "raised"
    for k, report in ((1, results[0]), (2, results[2])):
        assert report.output_ids == expected(model, tokenizer, conversation(k), 12)
    # A first turn that failed leaves a session with no history and no cache.
    info = manager.info("bad")
    assert (info.messages, info.cached_tokens) == (0, 0)
    manager.chat("bad", conversation(3), max_new_tokens=8)
    assert manager.last_turn("bad").output_ids == expected(model, tokenizer, conversation(3), 8)
    manager.close()


def test_a_streamer_whose_end_raises_fails_its_turn_not_the_engine(model, tokenizer):
    """Plain generate raises a streamer's ``end()`` error in its caller. Here
    it must too, and the engine must go on serving the manager's turns."""
    manager = SessionManager(model, tokenizer)
    thread, box = in_thread(
        lambda: manager.chat(
            "bad", conversation(0), max_new_tokens=5, streamer=Streamer(end_fails=True)
        )
    )
    thread.join(timeout=120)  # a hang guard: the engine's thread dying left it waiting
    assert not thread.is_alive(), "the turn never returned"
    assert engine_alive(manager), "the engine's thread died"
    assert isinstance(box.get("error"), RuntimeError), box
    manager.chat("next", conversation(1), max_new_tokens=6)
    assert manager.last_turn("next").output_ids == expected(model, tokenizer, conversation(1), 6)
    manager.close()


# ---------------------------------------------------------------- streams closed


def test_a_stream_cancelled_while_queued_ends_at_its_first_token(model, tokenizer):
    """A stream cancelled before its row left the queue: the turn ends after
    at most its first token, its session is exact, the others are untouched."""
    manager = SessionManager(model, tokenizer)
    with manager._engine.hold():
        stream = manager.stream_chat("gone", conversation(0), max_new_tokens=30, settle=False)
        next_piece, box = in_thread(lambda: next(stream, None))  # starts the worker
        other, other_box = in_thread(chat_call(manager, "a", conversation(1), 10))
        wait_for(lambda: manager.stats().queued == 2, "both queued")
        stream.cancel()
    next_piece.join()
    other.join()
    stream.close()
    assert other_box["result"].output_ids == expected(model, tokenizer, conversation(1), 10)
    got = manager.last_turn("gone").output_ids
    assert len(got) <= 1 and got == expected(model, tokenizer, conversation(0), 30)[: len(got)]
    info = manager.info("gone")
    assert info.cached_tokens == manager.last_turn("gone").prompt_tokens + len(got) - 1
    manager.close()


def test_a_stream_dropped_mid_decode_leaves_the_others_exact(model, tokenizer):
    """A stream dropped unread (a disconnected client) mid-decode: its row
    leaves within a token, the others go on, every session is exact."""
    manager = SessionManager(model, tokenizer)
    with manager._engine.hold():
        stream = manager.stream_chat("dropped", conversation(2), max_new_tokens=40)
        first, _ = in_thread(stream.__next__)
        others = [in_thread(chat_call(manager, f"s{k}", conversation(k), 16)) for k in (0, 1)]
        wait_for(lambda: manager.stats().queued == 3, "every turn queued")
    first.join()
    del stream
    gc.collect()
    for thread, _ in others:
        thread.join()
    for k, (_, box) in zip((0, 1), others, strict=True):
        assert box["result"].output_ids == expected(model, tokenizer, conversation(k), 16)
    wait_for(lambda: manager.last_turn("dropped") is not None, "the dropped turn commits")
    got = manager.last_turn("dropped").output_ids
    want = expected(model, tokenizer, conversation(2), 40)
    assert 1 <= len(got) < len(want) and got == want[: len(got)]
    manager.close()


# ---------------------------------------------------------------- close


def test_close_mid_decode_fails_the_turns_and_leaves_no_rows_behind(model, tokenizer):
    """``close()`` while two rows decode: both turns end with a clear error,
    and a turn after close runs alone in a fresh, empty batch."""
    manager = SessionManager(model, tokenizer)
    streams = [manager.stream_chat(f"s{k}", conversation(k), max_new_tokens=30) for k in (0, 1)]
    for stream in streams:
        next(stream)
    wait_for(lambda: manager.stats().batch_rows == 2, "both rows decoding")
    manager.close()
    for stream in streams:
        with pytest.raises(RuntimeError, match="closed"):
            list(stream)
    assert manager.stats().batch_rows == 0
    manager.chat("after", conversation(2), max_new_tokens=8)
    assert manager.last_turn("after").output_ids == expected(model, tokenizer, conversation(2), 8)
    stats = manager.stats()
    assert stats.batch_rows == 0 and stats.batch_bytes == 0, stats
    manager.close()


def test_close_fails_queued_and_prefilling_turns_clearly(model, tokenizer):
    """``close()`` with turns still queued: each ends with the 'closed' error
    rather than hanging, and the sessions are usable after."""
    manager = SessionManager(model, tokenizer, max_batch_size=1)
    with manager._engine.hold():
        calls = [in_thread(chat_call(manager, f"q{k}", conversation(k), 8)) for k in range(3)]
        wait_for(lambda: manager.stats().queued == 3, "every turn queued")
        manager.close()
    for thread, box in calls:
        thread.join()
        assert isinstance(box.get("error"), RuntimeError) and "closed" in str(box["error"]), box
    manager.chat("q0", conversation(0), max_new_tokens=8)
    assert manager.last_turn("q0").output_ids == expected(model, tokenizer, conversation(0), 8)
    manager.close()


def test_a_dropped_manager_ends_its_engine_thread(model, tokenizer):
    """Managers dropped without close() (then ``gc.collect()``) leave no
    engine thread behind."""
    for k in range(3):
        manager = SessionManager(model, tokenizer)
        manager.chat("s", conversation(k), max_new_tokens=3, settle=False)
        engine_thread = manager._engine._loop.thread
        assert engine_thread.is_alive() and engine_thread.name == "kvchat-engine"
        del manager
        gc.collect()
        wait_for(lambda t=engine_thread: not t.is_alive(), "the dropped manager's engine ends")


def test_a_dropped_manager_that_was_settling_ends_its_engine_thread(model, tokenizer):
    """The brief's recipe with settling on (the default): ``del manager;
    gc.collect()`` right after a chat turn, while its settle thread still
    runs; once that thread ends nothing holds the manager, and its engine
    must end without waiting for another full collection."""
    for k in range(3):
        manager = SessionManager(model, tokenizer)
        manager.chat("s", conversation(k), max_new_tokens=3)
        engine_thread = manager._engine._loop.thread
        engine = weakref.ref(manager._engine)
        del manager
        gc.collect()
        for thread in threading.enumerate():
            if thread.name == "kvchat-settle":
                thread.join()
        assert engine() is None, f"manager {k}: the engine outlived its manager"
        wait_for(lambda t=engine_thread: not t.is_alive(), "the engine's thread ends")


# ---------------------------------------------------------------- the batch's layout


def long_conversation() -> list[dict]:
    """About 600 tokens: the long system prompt and a few turns."""
    messages = [dict(SYSTEM, content=" ".join([LONG_SYSTEM["content"]] * 2))]
    for turn in range(3):
        messages += [user_message(turn), {"role": "assistant", "content": f"Noted, part {turn}."}]
    return [*messages, user_message(3)]


@pytest.mark.parametrize("long_at", [0, 2, 4], ids=["long-first", "long-middle", "long-last"])
def test_a_long_row_beside_short_ones_in_any_order(long_at, model, tokenizer):
    """One ~600-token conversation joins first (the others padded far left),
    in the middle or last (the batch grows its columns leftward) among four
    short ones: every reply is exact and every session holds its tokens."""
    long = long_conversation()
    assert render_prompt(tokenizer, long).numel() > 500
    chats = [conversation(k) for k in range(4)]
    chats.insert(long_at, long)
    manager = SessionManager(model, tokenizer, settle=False)
    budgets = [10 + 3 * (k % 3) for k in range(len(chats))]  # leaving at different steps
    reports = together(
        manager,
        [chat_call(manager, f"s{k}", chats[k], budgets[k]) for k in range(len(chats))],
    )
    for k, report in enumerate(reports):
        assert report.output_ids == expected(model, tokenizer, chats[k], budgets[k]), k
    assert manager.stats().max_batch_rows == len(chats)
    manager.close()


def test_a_long_row_joins_a_batch_already_decoding(model, tokenizer):
    """The long conversation arrives while short rows decode (so it is
    prefilled in chunks between their steps and joins a batch whose columns
    must grow leftward), then a short one joins after it."""
    manager = SessionManager(model, tokenizer, settle=False, max_step_tokens=64)
    short = manager.stream_chat("short", conversation(0), max_new_tokens=20)
    next(short)
    long = long_conversation()
    late = in_thread(chat_call(manager, "long", long, 12))
    wait_for(lambda: manager.stats().batch_rows == 2 or not late[0].is_alive(), "long joins")
    after = in_thread(chat_call(manager, "after", conversation(1), 8))
    list(short)
    for thread, _ in (late, after):
        thread.join()
    assert late[1]["result"].output_ids == expected(model, tokenizer, long, 12)
    assert after[1]["result"].output_ids == expected(model, tokenizer, conversation(1), 8)
    assert manager.last_turn("short").output_ids == expected(model, tokenizer, conversation(0), 20)
    assert manager.stats().prefill_chunks > 2  # the long prompt was chunked
    manager.close()


@pytest.mark.parametrize(
    "n, max_batch_size", [(9, 16), (17, 16), (5, 2), (3, 1)], ids=["9", "17", "5-by-2", "3-by-1"]
)
def test_many_conversations_past_each_row_capacity(n, max_batch_size, model, tokenizer):
    """More rows than 1, 2, 4, 8 (and 16) so the batch doubles its rows, or
    more than ``max_batch_size`` so rows queue: every reply exact."""
    manager = SessionManager(model, tokenizer, settle=False, max_batch_size=max_batch_size)
    chats = [conversation(k % 5) for k in range(n)]
    # Rows join one per step: every budget outlasts the joins, so all overlap.
    budgets = [min(20, n + 1 + k % 3) for k in range(n)]
    reports = together(
        manager, [chat_call(manager, f"s{k}", chats[k], budgets[k]) for k in range(n)]
    )
    for k, report in enumerate(reports):
        assert report.output_ids == expected(model, tokenizer, chats[k], budgets[k]), k
    stats = manager.stats()
    assert stats.max_batch_rows == min(n, max_batch_size), stats
    assert stats.batch_rows == 0 and stats.queued == 0
    manager.close()


# ---------------------------------------------------------------- what runs alone


def _decoding_streams(manager, n=2, max_new_tokens=20):
    """``n`` streamed chat turns, each past its first token (so decoding)."""
    streams = [
        manager.stream_chat(f"bg{k}", conversation(k), max_new_tokens=max_new_tokens)
        for k in range(n)
    ]
    for stream in streams:
        next(stream)
    return streams


def _finish_exact(manager, model, tokenizer, streams, max_new_tokens=20):
    for k, stream in enumerate(streams):
        list(stream)
        got = manager.last_turn(f"bg{k}").output_ids
        assert got == expected(model, tokenizer, conversation(k), max_new_tokens), k


def test_generate_variants_that_run_alone_beside_batched_turns(model, tokenizer):
    """``generate()`` with scores asked for, a padded attention mask, and a
    batch of two (each runs generate's own loop, alone on the engine), and
    with ``output_scores`` alone (batched: scores are not returned without
    ``return_dict_in_generate``), called while chat turns decode: each equals
    plain ``model.generate``, and the chat turns stay exact."""
    manager = SessionManager(model, tokenizer)
    a = render_prompt(tokenizer, conversation(0)).unsqueeze(0)
    b = render_prompt(tokenizer, conversation(1)).unsqueeze(0)
    pad = b.shape[1] - a.shape[1]
    batch = torch.cat([torch.cat([torch.zeros((1, pad), dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    calls = {
        "scores": (a, dict(return_dict_in_generate=True, output_scores=True)),
        "padded": (batch[:1], dict(attention_mask=mask[:1])),
        "batch": (batch, dict(attention_mask=mask)),
        "scores_only": (b, dict(output_scores=True)),
    }
    streams = _decoding_streams(manager)
    threads = {
        name: in_thread(
            lambda ids=ids, kw=kw, name=name: manager.generate(
                ids, session_id=name, max_new_tokens=10, do_sample=False, **kw
            )
        )
        for name, (ids, kw) in calls.items()
    }
    for thread, _ in threads.values():
        thread.join()
    _finish_exact(manager, model, tokenizer, streams)
    for name, (ids, kw) in calls.items():
        got = threads[name][1]
        assert "error" not in got, (name, got)
        want = model.generate(ids, max_new_tokens=10, do_sample=False, **kw)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got["result"], want), name
        else:
            assert torch.equal(got["result"].sequences, want.sequences), name
            for mine, theirs in zip(got["result"].scores, want.scores, strict=True):
                torch.testing.assert_close(mine, theirs)
    manager.close()


def test_an_autocast_turn_runs_plain_beside_batched_ones(model, tokenizer):
    """A caller under ``torch.autocast`` gets plain generate under its
    autocast (run alone on the engine); turns from other threads, without
    autocast, still decode batched and exact."""
    manager = SessionManager(model, tokenizer)
    streams = _decoding_streams(manager)

    def under_autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            manager.chat("ac", conversation(2), max_new_tokens=8)
        return manager.last_turn("ac")

    thread, box = in_thread(under_autocast)
    thread.join()
    _finish_exact(manager, model, tokenizer, streams)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = expected(model, tokenizer, conversation(2), 8)
    assert box["result"].output_ids == want
    assert box["result"].reason == "unsupported_generation"
    manager.close()


@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2", "qwen3_5", "falcon_h1"])
def test_a_long_prompt_prefilled_in_tiny_chunks_while_others_decode(family, tokenizer):
    """``max_step_tokens=8``: a ~600-token prompt is prefilled 8 tokens a
    step between two decoding rows' steps (across the sliding window, conv
    windows and recurrent states): exact, and so are the others; with
    ``prefill_chunk_size`` in the generation config too."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, max_step_tokens=8, settle=False)
    long = long_conversation()
    streams = _decoding_streams(manager, max_new_tokens=20)
    long_call = in_thread(chat_call(manager, "long", long, 10))
    chunked = in_thread(chat_call(manager, "chunked", conversation(3), 8, prefill_chunk_size=5))
    for thread, _ in (long_call, chunked):
        thread.join()
    _finish_exact(manager, model, tokenizer, streams)
    assert long_call[1].get("result") is not None, long_call[1]
    assert long_call[1]["result"].output_ids == expected(model, tokenizer, long, 10)
    want = expected(model, tokenizer, conversation(3), 8, prefill_chunk_size=5)
    assert chunked[1]["result"].output_ids == want
    assert manager.stats().prefill_chunks > 10
    manager.close()


# ---------------------------------------------------------------- other families


def test_mamba2_only_turns_decode_together_exactly(tokenizer):
    """A model of Mamba2 layers alone (no attention: the batch has only
    states, its cache cannot count its tokens) over two turns of three
    conversations."""
    from families import MAMBA2, tiny_from_config

    model = tiny_from_config("mamba2", torch.float64, MAMBA2, tokenizer)
    manager = SessionManager(model, tokenizer, settle=False)
    chats = [conversation(k) for k in range(3)]
    for _ in range(2):
        reports = together(
            manager, [chat_call(manager, f"m{k}", chats[k], 8 + 2 * k) for k in range(3)]
        )
        for k, report in enumerate(reports):
            want = expected(model, tokenizer, chats[k], 8 + 2 * k)
            assert report.output_ids == want, k
            reply = tokenizer.decode(want, skip_special_tokens=True)
            chats[k] = [*chats[k], {"role": "assistant", "content": reply}, user_message(5)]
    assert manager.stats().max_batch_rows == 3
    manager.close()


def test_dsa_indexed_turns_run_alone_beside_each_other_exactly(tokenizer, monkeypatch):
    """GLM-MoE-DSA's DynamicIndexedLayer cannot join a batch: its turns run
    generate's own loop alone on the engine; several at once stay exact and
    keep their caches."""
    from families import SHAPE, tiny_from_config
    from kvchat.bridge import probe

    monkeypatch.setattr(probe, "_split_problem", lambda model, arguments: None)
    fields = dict(
        SHAPE,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=1024,
        num_hidden_layers=3,
        first_k_dense_replace=3,
        indexer_types=["full", "shared", "full"],
    )
    model = tiny_from_config("glm_moe_dsa", torch.float64, fields, tokenizer)
    manager = SessionManager(model, tokenizer, settle=False)
    calls = [in_thread(chat_call(manager, f"d{k}", conversation(k), 6)) for k in range(3)]
    for thread, _ in calls:
        thread.join()
    for k, (_, box) in enumerate(calls):
        assert box.get("result") is not None, box
        assert box["result"].output_ids == expected(model, tokenizer, conversation(k), 6), k
    assert manager.stats().jobs_run_alone >= 3
    manager.close()


@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2"])
def test_no_forward_longer_than_max_step_tokens_while_rows_decode(family, tokenizer):
    """The issue's bound: while any row decodes, no forward takes more than
    ``max_step_tokens`` tokens, so a long prompt never stalls the others'
    streams for longer than a chunk. A forward hook records each forward's
    tokens and whether rows were decoding. LFM2's row, whose checkpoints
    would come off one forward over its tail (conv windows), goes in chunks
    too, stopping at its checkpoints."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, max_step_tokens=8, settle=False)
    loop = manager._engine._loop
    seen = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and threading.current_thread() is loop.thread:
            seen.append((ids.shape[1], len(loop.batch.rows)))

    streams = _decoding_streams(manager, max_new_tokens=20)
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        manager.chat("long", long_conversation(), max_new_tokens=4)
    finally:
        handle.remove()
    _finish_exact(manager, model, tokenizer, streams)
    stalls = [tokens for tokens, decoding in seen if decoding and tokens > 8]
    assert not stalls, f"forwards of {stalls} tokens while rows decoded"
    manager.close()


@pytest.mark.parametrize(
    ("family", "placement"),
    [("lfm2", "last"), ("lfm2", "every"), ("lfm2_moe", "last"), ("lfm3", "last")],
)
def test_a_conv_window_turn_chunked_beside_decoding_rows_keeps_its_checkpoints(
    family, placement, tokenizer
):
    """LFM2 reads a turn's checkpoints off one forward over its tail (conv
    windows). Here each turn's prompt starts while two rows decode: the tail
    goes in chunks of ``max_step_tokens``, stopping at each checkpoint. The
    first turn's (333 tokens) checkpoints are at the positions, and hold what
    the one forward gives a session whose first turn ran with nothing
    decoding; the second turn, which departs after the system prompt,
    restores the last checkpoint before it departs and equals plain generate
    (float64), and windows are still read (nothing was recorded as failing).
    With ``checkpoints="every"`` the second turn's tail, after a restored
    cache, has checkpoints of its own and is chunked too. LFM2-MoE and LFM3
    keep conv windows as LFM2 does."""
    if family == "lfm2":
        model = model_for(family)
    else:
        from families import CONV_WINDOWS, tiny_from_config

        model = tiny_from_config(family, torch.float64, CONV_WINDOWS[family], tokenizer)
    assert CacheBridge(model).checkpoints_from_windows
    first, second = [LONG_SYSTEM, user_message(0)], [LONG_SYSTEM, user_message(1)]
    alone = SessionManager(model, tokenizer, checkpoints=placement, settle=False)
    exact_turn(alone, "s", first, model, tokenizer)
    want = alone._core.find("s").cached_state().checkpoints
    alone.close()

    manager = SessionManager(
        model, tokenizer, checkpoints=placement, max_step_tokens=8, settle=False
    )
    loop = manager._engine._loop
    seen = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and threading.current_thread() is loop.thread:
            seen.append((ids.shape[1], len(loop.batch.rows)))

    reports = []
    for messages in (first, second):
        streams = _decoding_streams(manager, max_new_tokens=64)
        seen.clear()
        handle = model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            reports.append(exact_turn(manager, "s", messages, model, tokenizer)[1])
        finally:
            handle.remove()
        _finish_exact(manager, model, tokenizer, streams, max_new_tokens=64)
        prefills = [(tokens, decoding) for tokens, decoding in seen if tokens > 1]
        assert prefills and all(decoding and tokens <= 8 for tokens, decoding in prefills)
        if messages is first:
            got = manager._core.find("s").cached_state().checkpoints
            assert sum(tokens for tokens, _ in prefills) > 300, prefills
    assert len(got) == len(want) >= 2  # the system prompt's end, and the prompt's at least
    assert [c.position for c in got] == [c.position for c in want]
    for a, b in zip(want, got, strict=True):
        assert [s is None for s in a.states] == [s is None for s in b.states]
        for x, y in zip(a.states, b.states, strict=True):
            if x is None:
                continue
            assert y.meta == x.meta
            for u, v in zip(x.tensors(), y.tensors(), strict=True):
                torch.testing.assert_close(v, u, rtol=1e-12, atol=1e-12)
    assert manager._bridge.checkpoints_from_windows

    departs = common_prefix(render_prompt(tokenizer, first), render_prompt(tokenizer, second))
    restored = max(c.position for c in got if c.position <= departs)
    report = reports[1]
    assert report.checkpoint_restored == report.reused_tokens == restored > 0, report
    manager.close()


# ---------------------------------------------------------------- per-row options

ROW_OPTIONS = {
    "seeded": dict(do_sample=True, temperature=0.8, top_k=20, seed=7),
    "seeded-penalised": dict(do_sample=True, repetition_penalty=1.5, top_p=0.9, seed=11),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "min_new_tokens": dict(min_new_tokens=12),
    "bad_words_ids": None,  # filled in with the plain reply's first tokens
    "greedy": dict(),
}


def test_each_row_keeps_its_own_generation_options(model, tokenizer):
    """Seven rows decode together, each with its own options (seeded
    sampling, penalties, n-gram bans, a minimum length, banned words,
    greedy): each equals plain generate with those options (after
    ``torch.manual_seed(seed)`` when sampled)."""
    chats = {name: conversation(k % 5) for k, name in enumerate(ROW_OPTIONS)}
    plain = expected(model, tokenizer, chats["bad_words_ids"], 12)
    options = dict(ROW_OPTIONS, bad_words_ids=dict(bad_words_ids=[[plain[0]], [plain[2]]]))
    manager = SessionManager(model, tokenizer, settle=False)
    reports = together(
        manager, [chat_call(manager, name, chats[name], 12, **options[name]) for name in options]
    )
    for report, name in zip(reports, options, strict=True):
        kwargs = dict(options[name])
        seed = kwargs.pop("seed", None)
        prompt = render_prompt(tokenizer, chats[name])
        want = reference_ids(model, prompt, 12, seed=seed, **kwargs)
        assert report.output_ids == want, name
    assert reports[-2].output_ids != plain  # the ban did something
    assert manager.stats().max_batch_rows == len(options)
    manager.close()


# ---------------------------------------------------------------- sessions


def test_rows_decode_while_sessions_are_evicted_and_spilled(model, tokenizer, tmp_path):
    """``max_sessions=2`` with four conversations decoding together (each
    turn's release evicts another session to the spill folder), then a second
    turn of each: every reply exact, the second turns reload what was spilled."""
    manager = SessionManager(model, tokenizer, max_sessions=2, spill_dir=tmp_path, settle=False)
    chats = [conversation(k) for k in range(4)]
    for _ in range(2):
        reports = together(manager, [in_order(manager, f"e{k}", chats[k], 8) for k in range(4)])
        for k, report in enumerate(reports):
            want = expected(model, tokenizer, chats[k], 8)
            assert report.output_ids == want, k
            reply = tokenizer.decode(want, skip_special_tokens=True)
            chats[k] = [*chats[k], {"role": "assistant", "content": reply}, user_message(6)]
    assert sum(report.reused_tokens > 0 for report in reports) >= 2, reports
    assert len(manager.sessions()) == 4
    manager.close()


def in_order(manager, session, messages, max_new_tokens):
    """A chat call that reports, without chat_call's resident-cache check
    (an evicted session holds nothing here)."""

    def call():
        manager.chat(session, messages, max_new_tokens=max_new_tokens)
        return manager.last_turn(session)

    return call


def test_sessions_sharing_a_long_system_prompt_decode_together(model, tokenizer):
    """``share_prefixes=True``: four sessions on one long system prompt,
    started together (each may start from another's prefix while that one's
    row still decodes), then again: exact, and later ones share the prefix."""
    manager = SessionManager(model, tokenizer, share_prefixes=True, settle=False)
    manager.chat("first", [LONG_SYSTEM, user_message(9)], max_new_tokens=4)
    chats = [[LONG_SYSTEM, user_message(k)] for k in range(4)]
    reports = together(manager, [chat_call(manager, f"p{k}", chats[k], 10) for k in range(4)])
    for k, report in enumerate(reports):
        assert report.output_ids == expected(model, tokenizer, chats[k], 10), k
    assert all(report.reused_tokens > 100 for report in reports), reports
    assert manager.stats().max_batch_rows == 4
    manager.close()


def test_a_stream_cancelled_while_its_long_prompt_is_prefilled_in_chunks(model, tokenizer):
    """Cancelled while its ~600-token prompt is prefilled 8 tokens a step
    beside a decoding row (a long reply, closed once the check is done): the
    turn ends by its first token, its session holds exactly its tokens, and
    the decoding row's tokens are its plain generate's."""
    manager = SessionManager(model, tokenizer, max_step_tokens=8, settle=False)
    background = manager.stream_chat("bg", conversation(0), max_new_tokens=300, min_new_tokens=300)
    next(background)
    stream = manager.stream_chat("long", long_conversation(), max_new_tokens=20, settle=False)
    first, _ = in_thread(lambda: next(stream, None))
    wait_for(lambda: manager.stats().prefill_chunks >= 3, "the long prompt's chunks")
    stream.cancel()
    first.join()
    stream.close()
    background.close()
    got = manager.last_turn("bg").output_ids
    want = expected(model, tokenizer, conversation(0), 300, min_new_tokens=300)
    assert 1 <= len(got) and got == want[: len(got)]
    report = manager.last_turn("long")
    want = expected(model, tokenizer, long_conversation(), 20)
    assert report.generated_tokens <= 1 and report.output_ids == want[: report.generated_tokens]
    held = manager.info("long").cached_tokens
    assert held == report.prompt_tokens + report.generated_tokens - 1
    manager.close()


# ---------------------------------------------------------------- re-entry and edges


def _engine_waits_on_a_row(manager) -> bool:
    """Whether the engine's own thread is blocked waiting for a row to finish
    (which only it could finish)."""
    import sys

    thread = manager._engine._loop.thread
    frame = thread and sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and "engine" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def test_a_streamer_that_calls_the_manager_does_not_deadlock_it(model, tokenizer):
    """A user's streamer runs a short chat turn of another session at its
    first token (on the engine's thread, where every callback runs now). With
    plain generate that works; here it must work or raise, not hang."""
    manager = SessionManager(model, tokenizer, settle=False)
    inner: dict = {}

    class Nested(Streamer):
        def put(self, value):
            super().put(value)
            if len(self.puts) == 2:  # the first token
                try:
                    manager.chat("inner", conversation(1), max_new_tokens=4)
                    inner["ids"] = manager.last_turn("inner").output_ids
                except Exception as error:  # noqa: BLE001 - a clear error is fine
                    inner["error"] = error

    outer, box = in_thread(
        lambda: manager.chat("outer", conversation(0), max_new_tokens=6, streamer=Nested())
    )
    wait_for(
        lambda: not outer.is_alive() or _engine_waits_on_a_row(manager), "the turn or a deadlock"
    )
    deadlocked = outer.is_alive()
    if deadlocked:  # unblock the engine so the manager can close
        for row in list(manager._engine._loop.incoming):
            row.finish(RuntimeError("test cleanup"))
        outer.join()
    manager.close()
    assert not deadlocked, "the engine's thread waits for a row only it can run"
    assert "ids" in inner or "error" in inner
    if "ids" in inner:
        assert inner["ids"] == expected(model, tokenizer, conversation(1), 4)
    assert box.get("result") is not None, box


@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2", "qwen3_5"])
def test_one_token_replies_and_a_regenerated_turn_beside_decoding_rows(family, tokenizer):
    """Rows that finish at their first token (max_new_tokens=1, picked off
    the prefill: they never join the batch), and a session that regenerates
    its last turn (the same prompt again, its cache cut back), while two rows
    decode: exact, and each session holds prompt + generated - 1 tokens."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, settle=False)
    manager.chat("again", conversation(2), max_new_tokens=6)
    streams = _decoding_streams(manager)
    calls = [
        in_thread(chat_call(manager, "one", conversation(3), 1)),
        in_thread(chat_call(manager, "again", conversation(2), 6)),
    ]
    for thread, _ in calls:
        thread.join()
    _finish_exact(manager, model, tokenizer, streams)
    assert calls[0][1]["result"].output_ids == expected(model, tokenizer, conversation(3), 1)
    assert calls[1][1]["result"].output_ids == expected(model, tokenizer, conversation(2), 6)
    manager.close()
