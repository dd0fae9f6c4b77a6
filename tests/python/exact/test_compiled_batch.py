"""Conversations decoding together in the engine's compiled batch
(``compile=True``): each gives its own plain ``generate``'s tokens, rows join
and leave between steps, and no shape the batch has run compiles again.

Most tests compile with a backend that runs dynamo's graphs eagerly and
counts them (``CountingBackend``): dynamo traces the batch's forward as
inductor would get it, so a cache or mask it cannot trace, or a guard that
fails every step, shows here, in seconds. The slow ones compile with
inductor, as users run it. All in float64 on the test device.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
from helpers import SYSTEM, exact_turn, model_for, reference_ids, reference_turn, user_message
from kvchat import SessionManager
from kvchat.prompting import render_prompt
from kvchat.tiny import tiny_tokenizer
from test_compiled_decode import CountingBackend
from test_engine import FAMILIES, chat_call, conversation, decode_rounds, together, wait_for

FAST = ["llama", "gemma3", "lfm2"]  # attention, sliding window past it, conv


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _counting_manager(family, tokenizer, **options):
    torch._dynamo.reset()
    backend = CountingBackend()
    model = model_for(family)
    manager = SessionManager(model, tokenizer, compile=backend.config(), **options)
    return model, manager, backend


@pytest.mark.parametrize(
    "family",
    [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES],
)
def test_conversations_decode_together_compiled_exactly(family, tokenizer):
    """Three conversations of different lengths, two turns each (the second
    reuses each cache), decode in one compiled batch: each equals plain
    generate, every turn counts as compiled, and none used the pool."""
    model, manager, backend = _counting_manager(family, tokenizer)
    decode_rounds(manager, model, tokenizer, 3)
    stats = manager.stats()
    assert stats.max_batch_rows == 3 and stats.reused_tokens > 0, stats
    assert stats.compiled_turns == 6 and stats.static_caches_built == 0
    assert backend.graphs >= 1 and stats.compiles == backend.graphs
    assert manager._engine._loop.batch.static is True
    manager.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_inductor_compiled_batch_is_exact(family, tokenizer):
    """The same with inductor (``compile=True``), as users compile."""
    torch._dynamo.reset()
    model = model_for(family)
    manager = SessionManager(model, tokenizer, compile=True)
    decode_rounds(manager, model, tokenizer, 3)
    stats = manager.stats()
    assert stats.compiled_turns == 6 and stats.compiles >= 1 and stats.max_batch_rows == 3
    manager.close()


@pytest.mark.parametrize("family", FAST)
def test_rows_join_and_leave_a_compiled_batch(family, tokenizer):
    """A long reply streams while four shorter turns join its compiled batch
    (its rows grow past one) and leave it: every reply is exact, and every
    turn decoded compiled (the rows shrinking back:
    test_one_row_left_shrinks_the_static_batch)."""
    model, manager, _ = _counting_manager(family, tokenizer)
    long = conversation(0)
    stream = manager.stream_chat("long", long, max_new_tokens=60)
    pieces = [next(stream) for _ in range(3)]
    reports, threads = {}, []
    for k in range(1, 5):
        call = chat_call(manager, f"s{k}", conversation(k), 4 + 2 * k)
        threads.append(threading.Thread(target=lambda k=k, call=call: reports.update({k: call()})))
        threads[-1].start()
    wait_for(lambda: len(reports) == 4, "the joining turns finish")
    pieces.extend(stream)
    for thread in threads:
        thread.join()
    assert manager.last_turn("long").output_ids == reference_turn(model, tokenizer, long, 60)[2]
    for k in range(1, 5):
        assert (
            reports[k].output_ids == reference_turn(model, tokenizer, conversation(k), 4 + 2 * k)[2]
        )
    stats = manager.stats()
    assert stats.max_batch_rows >= 2 and stats.compiled_turns == 5, stats
    manager.close()


def test_no_shape_compiles_twice(tokenizer, caplog):
    """Rounds of 1, 2, 3, 4, 1, 2 and 4 conversations at once: the batch
    step compiles two graphs in all (one row; several rows, whose count and
    columns are dynamic sizes from that first compile), none for a shape it
    ran before, and the rounds after the first two compile nothing. Before
    kvchat marked those sizes dynamic, dynamo compiled up to four."""
    model, manager, backend = _counting_manager("llama", tokenizer)
    after = []
    with caplog.at_level("INFO", logger="kvchat"):
        for round_, n in enumerate((1, 2, 3, 4, 1, 2, 4)):
            decode_rounds(manager, model, tokenizer, n, rounds=1, prefix=f"r{round_}-")
            after.append(backend.graphs)
    assert after == [1, 2, 2, 2, 2, 2, 2], after
    assert "compiled the decode again" not in caplog.text
    manager.close()


@pytest.mark.parametrize("family", FAST)
def test_a_later_turn_in_the_next_bucket_compiles_nothing(family, tokenizer):
    """One conversation whose second turn needs the next bucket of columns,
    with no warm_up: the first compile already took the columns as a dynamic
    size, so the second turn compiles nothing (on an H200 the LFM2-shaped
    hybrid's turn 2 compiled once more, as dynamo saw the size change).
    Both turns are plain generate's."""
    model, manager, backend = _counting_manager(family, tokenizer)
    columns = []
    original = manager._compiled.batch_forward

    def batch_forward(model_, kwargs, shape):
        columns.append(shape[1])
        return original(model_, kwargs, shape)

    manager._compiled.batch_forward = batch_forward
    messages = [SYSTEM, user_message(0)]
    reply, _ = exact_turn(manager, "s", messages, model, tokenizer, 8)
    first = backend.graphs
    long_question = " ".join(user_message(k)["content"] for k in range(1, 40))
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": long_question},
    ]
    exact_turn(manager, "s", messages, model, tokenizer, 8)
    assert len(set(columns)) == 2, sorted(set(columns))  # the second turn's bucket is new
    assert first >= 1 and backend.graphs == first, (first, backend.graphs)
    manager.close()


def test_a_compiled_hybrid_step_updates_the_states_marked_static(tokenizer):
    """LFM2's conv states, updated in place by each step, are the batch's
    buffers marked static themselves, not views of them: on an H200
    inductor skipped CUDA graphs for the hybrid's compiled step ("mutated
    inputs"), as a view of a marked buffer is another, unmarked, input."""
    model, manager, backend = _counting_manager("lfm2", tokenizer)
    batch = manager._engine._loop.batch
    seen = []
    original = manager._compiled.batch_forward

    def batch_forward(model_, kwargs, shape):
        for index, kind, i, buffer in batch._recurrent:
            state = getattr(batch._cache.layers[index], f"{kind}_states")[i]
            seen.append(state is buffer and hasattr(state, "_dynamo_static_input_type"))
        return original(model_, kwargs, shape)

    manager._compiled.batch_forward = batch_forward
    decode_rounds(manager, model, tokenizer, 2, rounds=1)
    assert seen and all(seen), seen
    manager.close()


def test_warm_up_leaves_no_shape_to_compile(tokenizer):
    """warm_up(200) runs the step for one and two rows in 256 columns and
    in the next bucket, 512 (never allocating the larger row counts, which
    compile nothing more): two graphs, as rows and columns are dynamic
    sizes from the first compile, and afterwards three conversations
    together (four rows, in 512 columns) and one alone compile nothing."""
    model, manager, backend = _counting_manager("llama", tokenizer, max_batch_size=4)
    steps = []
    original = manager._compiled.batch_forward

    def batch_forward(model_, kwargs, shape):
        steps.append(shape)
        return original(model_, kwargs, shape)

    manager._compiled.batch_forward = batch_forward
    assert manager.warm_up(200) == [256, 512]
    assert set(steps) == {(rows, columns) for rows in (1, 2) for columns in (256, 512)}
    warmed = backend.graphs
    assert warmed == 2 and manager.stats().compiled_turns == 0
    decode_rounds(manager, model, tokenizer, 3, rounds=1)
    decode_rounds(manager, model, tokenizer, 1, rounds=1, prefix="alone")
    assert backend.graphs == warmed
    manager.close()


def test_per_row_options_in_a_compiled_batch(tokenizer):
    """A greedy row, a seeded sampled row and a row whose stop string ends
    it early decode in one compiled batch: each equals plain generate with
    its options (the sampled one after ``torch.manual_seed(seed)``), and the
    sampled one equals the same request alone."""
    model, manager, _ = _counting_manager("llama", tokenizer)
    chats = [conversation(k) for k in range(3)]
    # A word of a reply (random weights also write byte fragments, which no
    # stop string can match).
    free = reference_turn(model, tokenizer, chats[2], 12)[0]
    stop = re.findall(r"[A-Za-z]{3,}", free)[0]
    options = [
        dict(),
        dict(do_sample=True, temperature=0.9, top_k=20, seed=5),
        dict(stop_strings=[stop], tokenizer=tokenizer),
    ]
    reports = together(
        manager, [chat_call(manager, f"o{k}", chats[k], 12, **options[k]) for k in range(3)]
    )
    for k, report in enumerate(reports):
        kwargs = dict(options[k])
        seed = kwargs.pop("seed", None)
        if "stop_strings" in kwargs:
            want = reference_turn(model, tokenizer, chats[k], 12, **kwargs)[2]
            assert len(want) < 12  # the stop string matched
        else:
            want = reference_ids(model, render_prompt(tokenizer, chats[k]), 12, seed=seed, **kwargs)
        assert report.output_ids == want, k
    alone = SessionManager(model, tokenizer, compile=CountingBackend().config())
    alone.chat("o1", chats[1], max_new_tokens=12, settle=False, **options[1])
    assert alone.last_turn("o1").output_ids == reports[1].output_ids
    assert manager.stats().max_batch_rows == 3
    manager.close()
    alone.close()


def test_a_disable_compile_turn_decodes_alone_beside_compiled_rows(tokenizer):
    """A turn that passes disable_compile=True while two others decode in
    the compiled batch runs generate's own loop alone, eagerly: all three
    are exact, and only the two count as compiled."""
    model, manager, _ = _counting_manager("llama", tokenizer)
    chats = [conversation(k) for k in range(3)]
    streams = [manager.stream_chat(f"d{k}", chats[k], max_new_tokens=30) for k in range(2)]
    pieces = [[next(stream)] for stream in streams]  # both decoding
    eager = chat_call(manager, "d2", chats[2], 10, disable_compile=True)()
    for stream, got in zip(streams, pieces, strict=True):
        got.extend(stream)
    assert eager.output_ids == reference_turn(model, tokenizer, chats[2], 10)[2]
    for k in range(2):
        want = reference_turn(model, tokenizer, chats[k], 30)[2]
        assert manager.last_turn(f"d{k}").output_ids == want, k
    stats = manager.stats()
    assert stats.compiled_turns == 2 and stats.jobs_run_alone == 1 and stats.max_batch_rows == 2
    manager.close()


def test_one_row_left_shrinks_the_static_batch(tokenizer):
    """A static step runs every row it has room for: once most rows left,
    the batch is rebuilt smaller (the last one decodes in a one-row batch)."""
    model, manager, _ = _counting_manager("llama", tokenizer)
    batch = manager._engine._loop.batch
    capacities = []
    original = batch.step

    def step(model_, extra):
        capacities.append((len(batch.rows), batch._row_capacity))
        return original(model_, extra)

    batch.step = step
    budgets = [4, 4, 4, 4, 30]
    reports = together(
        manager,
        [chat_call(manager, f"k{k}", conversation(k), budgets[k]) for k in range(5)],
    )
    for k, report in enumerate(reports):
        assert report.output_ids == reference_turn(model, tokenizer, conversation(k), budgets[k])[2]
    assert (5, 8) in capacities and capacities[-1] == (1, 1), capacities
    manager.close()
