"""The compiled decode batch (``compile=True``) under what users do to it:
hybrid and sliding families whose rows join, leave, grow the columns and run
past them; padding rows that hold garbage; a backend that fails with several
rows at once; warm-ups of hybrids and beside running turns; the buffers'
bytes; cancelled, stopped, grammar-constrained and settled rows. Each reply
is plain ``generate``'s in float64 (test_compiled_batch.py has the basics).

Compiled with ``CountingBackend`` (dynamo traces, its graphs run eagerly).
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import LONG_SYSTEM, SYSTEM, model_for, reference_turn, user_message
from kvchat import SessionManager
from kvchat.engine import batch as batch_module
from kvchat.tiny import tiny_tokenizer
from test_compiled_decode import CountingBackend
from test_engine import chat_call, conversation, grammar_row_beside_free_ones, together, wait_for
from transformers import CompileConfig

HYBRIDS = ["gemma3", "lfm2", "qwen3_5", "falcon_h1", "nemotron_h"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _manager(family, tokenizer, **options):
    torch._dynamo.reset()
    backend = CountingBackend()
    model = model_for(family)
    manager = SessionManager(model, tokenizer, compile=backend.config(), **options)
    return model, manager, backend


def _small_columns(monkeypatch):
    """Column buckets of 32 and 8 columns of headroom: the static batch then
    rebuilds (a longer row joining) and compacts (a row decoding past its
    columns) within a few dozen tokens."""
    monkeypatch.setattr(batch_module, "_HEADROOM", 8)
    monkeypatch.setattr(batch_module, "bucket", lambda n: -(-n // 32) * 32)


def _exact(model, tokenizer, report, messages, budget, **kwargs):
    want = reference_turn(model, tokenizer, messages, budget, **kwargs)[2]
    assert report.output_ids == want


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_rows_rebuild_and_compact_a_compiled_batch(family, tokenizer, monkeypatch):
    """A short conversation streams a long reply; a shorter one and a long
    one (longer than every column the batch has: a rebuild) join it, the
    batch runs past its columns (compaction) several times, rows leave; a
    second round reuses every cache. Every reply is plain generate's."""
    _small_columns(monkeypatch)
    model, manager, _ = _manager(family, tokenizer)
    batch = manager._engine._loop.batch
    columns = []
    original = batch.step

    def step(model_, extra):
        out = original(model_, extra)
        columns.append(batch._columns)
        return out

    batch.step = step
    long = [LONG_SYSTEM, user_message(3)]
    chats = {"a": conversation(0), "b": conversation(1), "long": long}
    budgets = {"a": 70, "b": 12, "long": 30}
    for _ in range(2):
        stream = manager.stream_chat("a", chats["a"], max_new_tokens=budgets["a"], settle=False)
        next(stream)
        reports = {}
        threads = [
            threading.Thread(
                target=lambda s=s, reports=reports: reports.update(
                    {s: chat_call(manager, s, chats[s], budgets[s])()}
                )
            )
            for s in ("b", "long")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        list(stream)
        reports["a"] = manager.last_turn("a")
        for s, report in reports.items():
            _exact(model, tokenizer, report, chats[s], budgets[s])
            reply = tokenizer.decode(report.output_ids, skip_special_tokens=True)
            chats[s] = [*chats[s], {"role": "assistant", "content": reply}, user_message(9)]
    assert manager.stats().max_batch_rows >= 2
    assert batch.static and len(set(columns)) >= 3, sorted(set(columns))
    assert manager.stats().batch_bytes == 0
    manager.close()


def _poison_padding_rows(batch):
    """After every leave, fills the rows past the ones in use with NaN (what
    a row whose activations overflowed leaves behind in a padding row)."""
    original = batch.leave

    def leave(row, write_back=True):
        original(row, write_back)
        if batch._cache is None:
            return
        used = batch._geo.rows
        for buffer, _ in batch._buffers_of(batch._cache):
            if buffer.is_floating_point():
                buffer[used:] = float("nan")

    batch.leave = leave


@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2", "falcon_h1"])
def test_a_padding_rows_garbage_never_reaches_a_row(family, tokenizer):
    """Four rows fill a four-row static batch; one leaves (its slot is now a
    padding row, full of garbage: NaN here), and a new conversation joins
    into that slot while the others go on decoding. Every reply is plain
    generate's: a padding row, and what a row left in its slot's columns,
    never reaches a row's logits."""
    model, manager, _ = _manager(family, tokenizer)
    batch = manager._engine._loop.batch
    _poison_padding_rows(batch)
    budgets = [40, 40, 40, 3]
    chats = [conversation(k) for k in range(4)]
    streams = []
    with manager._engine.hold():
        for k in range(3):
            streams.append(
                manager.stream_chat(f"s{k}", chats[k], max_new_tokens=budgets[k], settle=False)
            )
        short = threading.Thread(target=chat_call(manager, "s3", chats[3], budgets[3]))
        short.start()
        wait_for(lambda: manager.stats().queued == 4, "every turn queued")
    pieces = [[next(stream)] for stream in streams]
    short.join()
    assert manager.stats().max_batch_rows == 4
    # Joins the slot the short row left, in columns a longer row had.
    joined = [SYSTEM, user_message(8)]
    chat_call(manager, "new", joined, 8)()
    for stream, got in zip(streams, pieces, strict=True):
        got.extend(stream)
    _exact(model, tokenizer, manager.last_turn("new"), joined, 8)
    for k in range(4):
        _exact(model, tokenizer, manager.last_turn(f"s{k}"), chats[k], budgets[k])
    manager.close()


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_a_left_rows_garbage_never_reaches_the_row_moved_into_its_slot(family, tokenizer):
    """Three rows decode; the first (slot 0) ends, and the last row moves
    into its slot. The left row's columns outside the batch's [lo, hi) hold
    garbage (NaN here: what overflowed activations leave); a static step
    reads every column, so the moved row must bring its whole slot, not
    only [lo, hi). Every reply is plain generate's."""
    model, manager, _ = _manager(family, tokenizer)
    batch = manager._engine._loop.batch
    original, moves = batch.leave, []

    def leave(row, write_back=True):
        geo = batch._geo
        if row.slot != geo.rows - 1:  # the last row will move into this slot
            moves.append(row.slot)
            for index in batch._attention:
                layer = batch._cache.layers[index]
                for buffer in (layer.kbuf, layer.vbuf):
                    buffer[row.slot, :, : geo.lo] = float("nan")
                    buffer[row.slot, :, geo.hi :] = float("nan")
        original(row, write_back)

    batch.leave = leave
    chats, budgets = [conversation(k) for k in range(3)], [4, 30, 30]
    reports = together(
        manager, [chat_call(manager, f"m{k}", chats[k], budgets[k]) for k in range(3)]
    )
    assert moves and moves[0] == 0, moves
    for k, report in enumerate(reports):
        _exact(model, tokenizer, report, chats[k], budgets[k])
    assert batch.static and manager.stats().max_batch_rows == 3
    manager.close()


def test_a_failing_backend_fails_every_row_of_the_step_cleanly(tokenizer, caplog):
    """Three turns decode together when the backend fails at the batch's
    first compiled step: each turn raises, none leaves its session half
    updated (history and the cache's next turn), the manager decodes eagerly
    from then on, exactly, and its stats say so."""

    def broken(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, compile=CompileConfig(backend=broken, mode=None))
    chats = [conversation(k) for k in range(3)]
    for k in range(3):  # a first turn each, eagerly (disable_compile): caches to reuse
        manager.chat(f"s{k}", chats[k], max_new_tokens=6, disable_compile=True)
    before = {f"s{k}": manager.messages(f"s{k}") for k in range(3)}
    nexts = []
    for k in range(3):
        reply = manager.messages(f"s{k}")[-1]["content"]
        nexts.append([*chats[k], {"role": "assistant", "content": reply}, user_message(5 + k)])
    errors = []

    def call(k):
        try:
            manager.chat(f"s{k}", nexts[k], max_new_tokens=10, settle=False)
        except Exception as error:  # noqa: BLE001 - asserted below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
    with manager._engine.hold():
        for k, thread in enumerate(threads):
            thread.start()
            wait_for(lambda k=k: manager.stats().queued + len(errors) > k, f"turn {k} queued")
    for thread in threads:
        thread.join()
    assert len(errors) == 3, errors
    assert all(isinstance(e, torch._dynamo.exc.TorchDynamoException) for e in errors), errors
    assert "decodes eagerly from now on" in caplog.text
    for k in range(3):
        assert manager.messages(f"s{k}") == before[f"s{k}"], k
    stats = manager.stats()
    assert stats.batch_rows == 0 and stats.batch_bytes == 0 and stats.compiled_turns == 0
    reports = together(manager, [chat_call(manager, f"s{k}", nexts[k], 10) for k in range(3)])
    for k, report in enumerate(reports):
        _exact(model, tokenizer, report, nexts[k], 10)
    stats = manager.stats()
    assert stats.compiled_turns == 0 and stats.max_batch_rows == 3
    assert manager._engine._loop.batch.static is False
    manager.close()


@pytest.mark.parametrize("family", HYBRIDS)
def test_warm_up_of_a_hybrid_leaves_nothing_to_compile(family, tokenizer):
    """warm_up(200) on a hybrid or sliding family with four rows at most:
    three conversations together, two turns each, and one alone compile
    nothing after it, and are exact."""
    model, manager, backend = _manager(family, tokenizer, max_batch_size=4)
    manager.warm_up(200)
    warmed = backend.graphs
    assert warmed >= 2
    chats = [conversation(k) for k in range(3)]
    for _ in range(2):
        reports = together(manager, [chat_call(manager, f"s{k}", chats[k], 10) for k in range(3)])
        for k, report in enumerate(reports):
            _exact(model, tokenizer, report, chats[k], 10)
            reply = tokenizer.decode(report.output_ids, skip_special_tokens=True)
            chats[k] = [*chats[k], {"role": "assistant", "content": reply}, user_message(6)]
    _exact(model, tokenizer, chat_call(manager, "alone", chats[0][:2], 10)(), chats[0][:2], 10)
    assert backend.graphs == warmed, (warmed, backend.graphs)
    manager.close()


def test_warm_up_while_turns_decode(tokenizer, caplog):
    """warm_up on one thread while two conversations stream on others:
    the streaming replies are exact, warm_up returns its capacities, and
    what those turns compile afterwards is nothing."""
    model, manager, backend = _manager("llama", tokenizer, max_batch_size=4)
    chats = [conversation(k) for k in range(3)]
    streams = [
        manager.stream_chat(f"s{k}", chats[k], max_new_tokens=40, settle=False) for k in range(2)
    ]
    pieces = [[next(stream)] for stream in streams]
    with caplog.at_level("INFO", logger="kvchat"):
        assert manager.warm_up(200) == [256, 512]
    for stream, got in zip(streams, pieces, strict=True):
        got.extend(stream)
    for k in range(2):
        _exact(model, tokenizer, manager.last_turn(f"s{k}"), chats[k], 40)
    warmed = backend.graphs
    reports = together(manager, [chat_call(manager, f"t{k}", chats[k], 8) for k in range(3)])
    for k, report in enumerate(reports):
        _exact(model, tokenizer, report, chats[k], 8)
    assert backend.graphs == warmed
    assert "compiled the decode again" not in caplog.text
    stats = manager.stats()
    assert stats.compiled_turns == 5 and stats.batch_bytes == 0
    manager.close()


def test_the_static_batchs_bytes_are_counted_then_freed(tokenizer):
    """While rows decode, stats' batch_bytes is the static buffers' size
    (rows in powers of two, columns a bucket) and the core reserves it;
    once no row decodes, both are zero."""
    model, manager, _ = _manager("llama", tokenizer)
    batch = manager._engine._loop.batch
    seen = []
    original = batch.step

    def step(model_, extra):
        seen.append((manager.stats().batch_bytes, batch.nbytes(), batch._row_capacity))
        assert manager._core.reserved_bytes == batch.nbytes()
        return original(model_, extra)

    batch.step = step
    together(manager, [chat_call(manager, f"s{k}", conversation(k), 6) for k in range(3)])
    assert seen and all(reported == real > 0 for reported, real, _ in seen), seen
    assert any(rows == 4 for _, _, rows in seen)
    stats = manager.stats()
    assert stats.batch_rows == 0 and stats.batch_bytes == 0
    assert manager._core.reserved_bytes == 0
    manager.close()


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_cancelled_and_stopped_rows_in_a_compiled_batch(family, tokenizer):
    """One row's stream is closed early and another's stop string ends it
    while a third decodes on, in one compiled batch; then each session's
    next turn (the cancelled one too) is exact."""
    model, manager, _ = _manager(family, tokenizer)
    chats = [conversation(k) for k in range(3)]
    reply = tokenizer.decode(reference_turn(model, tokenizer, chats[1], 16)[2])
    stop = reply[len(reply) // 2 : len(reply) // 2 + 2]
    assert stop.strip(), reply
    with manager._engine.hold():
        stream = manager.stream_chat("c0", chats[0], max_new_tokens=40, settle=False)
        stopped = threading.Thread(
            target=chat_call(manager, "c1", chats[1], 16, stop_strings=[stop], tokenizer=tokenizer)
        )
        free = threading.Thread(target=chat_call(manager, "c2", chats[2], 30))
        stopped.start()
        free.start()
        wait_for(lambda: manager.stats().queued == 3, "every turn queued")
    wait_for(lambda: manager.stats().batch_rows == 3, "three rows decoding")
    next(stream)
    next(stream)
    stream.close()
    stopped.join()
    free.join()
    got = manager.last_turn("c0").output_ids
    want = reference_turn(model, tokenizer, chats[0], 40)[2]
    assert 2 <= len(got) < len(want) and got == want[: len(got)]
    stopped_want = reference_turn(
        model, tokenizer, chats[1], 16, stop_strings=[stop], tokenizer=tokenizer
    )[2]
    assert manager.last_turn("c1").output_ids == stopped_want and len(stopped_want) < 16
    _exact(model, tokenizer, manager.last_turn("c2"), chats[2], 30)
    nexts = []
    for k in range(3):
        text = tokenizer.decode(manager.last_turn(f"c{k}").output_ids, skip_special_tokens=True)
        nexts.append([*chats[k], {"role": "assistant", "content": text}, user_message(4)])
    reports = together(manager, [chat_call(manager, f"c{k}", nexts[k], 8) for k in range(3)])
    for k, report in enumerate(reports):
        _exact(model, tokenizer, report, nexts[k], 8)
        assert report.reused_tokens > 0
    assert manager.stats().compiled_turns == 6
    manager.close()


def test_a_grammar_row_beside_free_ones_in_a_compiled_batch(tokenizer):
    model, manager, _ = _manager("llama", tokenizer)
    grammar_row_beside_free_ones(manager, model, tokenizer)
    stats = manager.stats()
    assert stats.max_batch_rows == 3 and stats.compiled_turns == 3
    manager.close()


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_settled_turns_in_a_compiled_batch(family, tokenizer):
    """settle=True (the default): each session is settled on the engine's
    idle work between compiled steps; three conversations, three turns each,
    every reply exact and every later turn reusing its settled cache."""
    model, manager, _ = _manager(family, tokenizer)
    chats = [conversation(k) for k in range(3)]

    def call(k):
        def run():
            manager.chat(f"s{k}", chats[k], max_new_tokens=10 + k)
            return manager.last_turn(f"s{k}")

        return run

    for turn in range(3):
        reports = together(manager, [call(k) for k in range(3)])
        for k, report in enumerate(reports):
            _exact(model, tokenizer, report, chats[k], 10 + k)
            if turn:
                assert report.reused_tokens > 0
            text = tokenizer.decode(report.output_ids, skip_special_tokens=True)
            chats[k] = [*chats[k], {"role": "assistant", "content": text}, user_message(turn + 4)]
    stats = manager.stats()
    assert stats.compiled_turns == 9 and stats.max_batch_rows == 3
    manager.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2", "qwen3_5", "falcon_h1"])
def test_half_precision_rows_decoding_together_compiled(family, dtype, tokenizer):
    """test_bfloat16.py's promises for rows decoding together, in the
    compiled (static) batch: a first turn is plain generate's reply, later
    turns' first tokens are plain generate's where the best token leads
    clearly, and every reply is finite text (no NaN from the masked columns
    a static step reads)."""
    from helpers import check_low_precision_replies, plain_with_margin
    from kvchat.prompting import render_prompt
    from kvchat.tiny import tiny_model

    torch._dynamo.reset()
    model = tiny_model(family, dtype=dtype, seed=0).to(model_for("llama").device)
    manager = SessionManager(model, tokenizer, compile=CountingBackend().config())
    sessions = [[LONG_SYSTEM] + [user_message(10 * k + j) for j in range(k)] for k in range(3)]
    checked = 0
    for turn in range(3):
        expected = {}
        for k, messages in enumerate(sessions):
            messages.append(user_message(turn))
            expected[k] = plain_with_margin(model, render_prompt(tokenizer, messages))
        reports = together(
            manager, [chat_call(manager, f"s{k}", sessions[k], 12) for k in range(3)]
        )
        checked += check_low_precision_replies(
            enumerate(reports), expected, turn, sessions, tokenizer
        )
    stats = manager.stats()
    assert stats.max_batch_rows == 3 and stats.compiled_turns == 9
    assert checked >= 3, f"only {checked} later turns had a clear first token"
    manager.close()


def test_every_manager_in_a_process_compiles_its_batch(tokenizer, caplog):
    """Five managers, one after another in one process (five models: a
    server of several, a notebook making a manager again), each with rounds
    of one, two and three conversations: every one's batch step compiles
    (its graphs counted by its own backend) and its replies are exact. The
    batch's compiled function was one code object for the whole process,
    whose recompile limit (8 graphs) the first four managers spent: the
    fifth decoded eagerly, silently, while counting its turns as compiled."""
    torch._dynamo.reset()
    for seed in range(5):
        backend = CountingBackend()
        model = model_for("llama", seed=seed)
        manager = SessionManager(model, tokenizer, compile=backend.config())
        for n in (1, 2, 3):
            chats = [conversation(k) for k in range(n)]
            reports = together(
                manager, [chat_call(manager, f"r{n}-{k}", chats[k], 6) for k in range(n)]
            )
            for k, report in enumerate(reports):
                _exact(model, tokenizer, report, chats[k], 6)
        stats = manager.stats()
        assert backend.graphs >= 2 and stats.compiles == backend.graphs, (seed, backend.graphs)
        assert stats.compiled_turns == 6
        manager.close()
    assert "recompile_limit" not in caplog.text


def test_pooled_turns_beside_the_compiled_batch(tokenizer):
    """While two conversations decode in the compiled batch, a turn with its
    own compile_config and a generate that asks for its returned dict each
    decode alone in a pooled StaticCache (generate compiles those): all four
    are plain generate's tokens, and each counts as compiled."""
    from helpers import reference_ids

    model, manager, _ = _manager("llama", tokenizer)
    chats = [conversation(k) for k in range(3)]
    streams = [
        manager.stream_chat(f"b{k}", chats[k], max_new_tokens=40, settle=False) for k in range(2)
    ]
    pieces = [[next(stream)] for stream in streams]
    own = CountingBackend()
    report = chat_call(manager, "own", chats[2], 10, compile_config=own.config())()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    out = manager.generate(
        ids, "dict", max_new_tokens=6, do_sample=False, return_dict_in_generate=True
    )
    for stream, got in zip(streams, pieces, strict=True):
        got.extend(stream)
    _exact(model, tokenizer, report, chats[2], 10)
    assert tuple(out.sequences[0, 8:].tolist()) == reference_ids(model, ids[0], 6)
    for k in range(2):
        _exact(model, tokenizer, manager.last_turn(f"b{k}"), chats[k], 40)
    stats = manager.stats()
    assert own.graphs >= 1 and stats.static_caches_built >= 1, stats
    assert stats.compiled_turns == 4 and stats.max_batch_rows == 2
    manager.close()


def test_a_turn_prefilling_when_the_compile_fails_decodes_eagerly_and_says_so(tokenizer):
    """The backend fails at the batch's first step while a long prompt is
    still prefilling in chunks beside it: the decoding turn raises, the long
    one then decodes eagerly, exactly, and is not counted as compiled (no
    turn decoded compiled: compiled_turns stays 0)."""

    def broken(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    model = model_for("llama")
    manager = SessionManager(
        model,
        tokenizer,
        compile=CompileConfig(backend=broken, mode=None),
        max_step_tokens=16,
    )
    short, long = conversation(0), conversation(4)
    errors, reports = [], {}

    def first():
        try:
            manager.chat("short", short, max_new_tokens=10, settle=False)
        except Exception as error:  # noqa: BLE001 - asserted below
            errors.append(error)

    threads = [
        threading.Thread(target=first),
        threading.Thread(
            target=lambda: reports.update(long=chat_call(manager, "long", long, 10)())
        ),
    ]
    with manager._engine.hold():
        for k, thread in enumerate(threads):
            thread.start()
            wait_for(lambda k=k: manager.stats().queued + len(errors) > k, f"turn {k} queued")
    for thread in threads:
        thread.join()
    assert len(errors) == 1 and isinstance(errors[0], torch._dynamo.exc.TorchDynamoException)
    _exact(model, tokenizer, reports["long"], long, 10)
    stats = manager.stats()
    assert stats.prefill_chunks > 2, stats  # the long prompt was in chunks meanwhile
    assert stats.compiled_turns == 0, stats
    manager.close()


@pytest.mark.parametrize("family", ["llama", "lfm2", "qwen3_5", "falcon_h1"])
def test_a_long_prompt_prefills_in_chunks_between_compiled_steps(family, tokenizer):
    """With a row decoding in the compiled batch, a long prompt is prefilled
    in chunks of max_step_tokens (an LFM2 one stopping at its checkpoints),
    eagerly, between compiled steps; both replies are plain generate's and
    both turns count as compiled, and the next turn reuses the long one."""
    model, manager, _ = _manager(family, tokenizer, max_step_tokens=16)
    stream = manager.stream_chat("decoding", conversation(0), max_new_tokens=60, settle=False)
    next(stream)
    long = conversation(4)
    before = manager.stats()
    report = chat_call(manager, "long", long, 8)()
    stats = manager.stats()
    list(stream)
    _exact(model, tokenizer, report, long, 8)
    _exact(model, tokenizer, manager.last_turn("decoding"), conversation(0), 60)
    assert stats.prefill_chunks - before.prefill_chunks >= 3
    assert stats.decode_steps - before.decode_steps >= 3  # steps between the chunks
    text = tokenizer.decode(report.output_ids, skip_special_tokens=True)
    nxt = [*long, {"role": "assistant", "content": text}, user_message(7)]
    again = chat_call(manager, "long", nxt, 8)()
    _exact(model, tokenizer, again, nxt, 8)
    assert again.reused_tokens > 0
    assert manager.stats().compiled_turns == 3
    manager.close()


def test_warm_up_with_a_failing_backend_raises_then_turns_decode_eagerly(tokenizer):
    """warm_up with a backend that cannot compile raises dynamo's error,
    frees its batch, and leaves a manager whose turns decode eagerly
    together, exactly; nothing counts as compiled."""

    def broken(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    model = model_for("lfm2")
    manager = SessionManager(model, tokenizer, compile=CompileConfig(backend=broken, mode=None))
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        manager.warm_up(200)
    assert manager.stats().batch_bytes == 0
    chats = [conversation(k) for k in range(3)]
    reports = together(manager, [chat_call(manager, f"s{k}", chats[k], 8) for k in range(3)])
    for k, report in enumerate(reports):
        _exact(model, tokenizer, report, chats[k], 8)
    stats = manager.stats()
    assert stats.compiled_turns == 0 and stats.max_batch_rows == 3
    assert manager._engine._loop.batch.static is False
    assert manager.warm_up(200) == []  # nothing to compile now
    manager.close()


def test_a_model_that_disables_compile_still_batches_its_turns(tokenizer):
    """A model whose generation_config.json says disable_compile: generate
    decodes it eagerly, and so does a manager made with compile=True; its
    turns must still decode together in the (eager) batch, as with
    compile=False, not each alone one after another. A turn that asks to
    compile anyway (disable_compile=False) decodes alone, compiled."""
    from helpers import DEVICE
    from kvchat.tiny import tiny_model

    torch._dynamo.reset()
    model = tiny_model("llama", dtype=torch.float64, seed=0).to(DEVICE)
    model.generation_config.disable_compile = True
    backend = CountingBackend()
    manager = SessionManager(model, tokenizer, compile=backend.config())
    chats = [conversation(k) for k in range(3)]
    with manager._engine.hold():
        threads = [
            threading.Thread(target=chat_call(manager, f"s{k}", chats[k], 10)) for k in range(3)
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: manager.stats().queued == 3, "every turn queued in the batch")
    for thread in threads:
        thread.join()
    for k in range(3):
        _exact(model, tokenizer, manager.last_turn(f"s{k}"), chats[k], 10)
    stats = manager.stats()
    assert stats.max_batch_rows == 3 and stats.jobs_run_alone == 0, stats
    assert stats.compiled_turns == 0 and backend.graphs == 0
    report = chat_call(manager, "c", chats[0], 10, disable_compile=False)()
    _exact(model, tokenizer, report, chats[0], 10)
    stats = manager.stats()
    assert stats.compiled_turns == 1 and stats.static_caches_built == 1 and backend.graphs >= 1
    manager.close()


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_a_hybrids_disable_compile_turn_alone_keeps_its_checkpoints(family, tokenizer):
    """A hybrid's disable_compile turn decodes alone (generate's own loop)
    while two rows decode compiled; its next turn, compiled in the batch,
    reuses its cache, and an edit of its last user message restores a
    checkpoint: every reply plain generate's."""
    model, manager, _ = _manager(family, tokenizer)
    chats = [conversation(k) for k in range(2)]
    streams = [
        manager.stream_chat(f"b{k}", chats[k], max_new_tokens=40, settle=False) for k in range(2)
    ]
    pieces = [[next(stream)] for stream in streams]
    messages = [LONG_SYSTEM, user_message(0)]
    first = chat_call(manager, "h", messages, 8, disable_compile=True)()
    for stream, got in zip(streams, pieces, strict=True):
        got.extend(stream)
    _exact(model, tokenizer, first, messages, 8)
    for k in range(2):
        _exact(model, tokenizer, manager.last_turn(f"b{k}"), chats[k], 40)
    text = tokenizer.decode(first.output_ids, skip_special_tokens=True)
    messages = [*messages, {"role": "assistant", "content": text}, user_message(1)]
    second = chat_call(manager, "h", messages, 8)()
    _exact(model, tokenizer, second, messages, 8)
    assert second.reused_tokens > 0
    messages[-1] = user_message(2)  # the last user message edited
    third = chat_call(manager, "h", messages, 8)()
    _exact(model, tokenizer, third, messages, 8)
    assert third.reused_tokens > 0
    assert manager.stats().compiled_turns == 4
    manager.close()


@pytest.mark.parametrize(
    "family", ["llama", "gemma3", "lfm2", "qwen3_5", "falcon_h1", "nemotron_h"]
)
def test_rows_of_a_static_batch_decode_on_eagerly_once_compiling_fails(family, tokenizer):
    """Two rows decode in the compiled (static) batch when a turn with its
    own compile_config, whose backend cannot compile, fails: compiling is
    off from then on, and the two rows decode their remaining steps eagerly
    in the static layout, exactly; the turns after them too."""

    def broken(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    model, manager, _ = _manager(family, tokenizer)
    chats = [conversation(k) for k in range(3)]
    streams = [
        manager.stream_chat(f"b{k}", chats[k], max_new_tokens=40, settle=False) for k in range(2)
    ]
    pieces = [[next(stream), next(stream)] for stream in streams]
    assert manager._engine._loop.batch.static
    bad = CompileConfig(backend=broken, mode=None)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        manager.chat("bad", chats[2], max_new_tokens=10, compile_config=bad, settle=False)
    for stream, got in zip(streams, pieces, strict=True):
        got.extend(stream)
    for k in range(2):
        _exact(model, tokenizer, manager.last_turn(f"b{k}"), chats[k], 40)
    reports = together(manager, [chat_call(manager, f"n{k}", chats[k], 8) for k in range(3)])
    for k, report in enumerate(reports):
        _exact(model, tokenizer, report, chats[k], 8)
    stats = manager.stats()
    assert stats.compiled_turns == 0 and stats.batch_bytes == 0
    manager.close()
