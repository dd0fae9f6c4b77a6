"""Attacks on the prompts that start together (engine/prompts.py), in float64
unless named: prompts of very different lengths in one forward, prompts that
extend one another, raw ids, stop strings, grammars, seeds and penalties on a
grouped row, a turn cancelled or a forward failing while grouped, half
precision, a tight ``max_cache_bytes``, and a forward that takes
``logits_to_keep`` only as an int. Every reply is its own plain ``generate``'s."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from helpers import LONG_SYSTEM, model_for, reference_ids, reference_turn, user_message
from kvchat import SessionManager
from kvchat.agents.grammar import Grammars
from kvchat.prompting import end_ids, render_prompt
from kvchat.tiny import tiny_model, tiny_tokenizer
from test_engine import chat_call, together, wait_for


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def many_turns(k: int, turns: int) -> list[dict]:
    """A conversation of ``turns`` user messages (with replies between)."""
    messages = [{"role": "system", "content": f"Agent {k}."}]
    for turn in range(turns):
        messages.append(user_message(10 * k + turn))
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"Done, step {turn}."})
    return messages


def generate_call(manager, session, ids, max_new_tokens, **kwargs):
    def call():
        out = manager.generate(
            ids[None], session_id=session, max_new_tokens=max_new_tokens, **kwargs
        )
        return tuple(out[0, ids.numel() :].tolist())

    return call


def failure_of(call):
    """``call`` returning the exception it raises (None if it returns)."""

    def run():
        try:
            call()
        except Exception as error:  # noqa: BLE001 - what the test checks
            return error
        return None

    return run


def grouped(manager) -> int:
    return manager.stats().prompts_prefilled_together


def test_one_new_token_beside_two_hundred_in_one_forward(tokenizer):
    """A row whose cache holds all its prompt but the last token (raw ids:
    the previous prompt and reply) prefills beside a 200-token first turn and
    a middling one: one forward, right-padded by 199 tokens; each is plain
    generate's."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    first = render_prompt(tokenizer, many_turns(0, 1))
    out = generate_call(manager, "n1", first, 5)()
    assert out == reference_ids(model, first, 5)
    again = torch.cat([first, torch.tensor(out)])
    long = render_prompt(tokenizer, many_turns(1, 6))
    middle = render_prompt(tokenizer, many_turns(2, 3))
    assert long.numel() > 200 > middle.numel()
    before = grouped(manager)
    got = together(
        manager,
        [
            generate_call(manager, "n1", again, 6),
            generate_call(manager, "long", long, 6),
            generate_call(manager, "middle", middle, 6),
        ],
    )
    assert got == [reference_ids(model, p, 6) for p in (again, long, middle)]
    assert grouped(manager) - before == 3
    assert manager.info("n1").cached_tokens == again.numel() + 5
    manager.close()


def test_prompts_that_extend_one_another_start_together(tokenizer):
    """C extends B extends A (each a later point of one conversation, in
    three sessions), and two sessions send the very same prompt: each copies
    what the one before it computed, never its own last prompt token, and
    every reply is plain generate's."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    a = many_turns(3, 2)
    b = [*a, {"role": "assistant", "content": "Fine."}, user_message(4)]
    c = [*b, {"role": "assistant", "content": "Sure."}, user_message(5)]
    calls = [
        chat_call(manager, "c", c, 6),
        chat_call(manager, "a", a, 6),
        chat_call(manager, "b", b, 6),
        chat_call(manager, "a-twin", a, 6),
        chat_call(manager, "c-twin", c, 6),
    ]
    reports = together(manager, calls)
    for report, messages in zip(reports, [c, a, b, a, c], strict=True):
        assert report.output_ids == reference_turn(model, tokenizer, messages, 6)[2]
    assert manager.stats().prefix_tokens_copied > 0
    manager.close()


def test_the_same_prompt_in_two_sessions_copies_all_but_its_last_token(tokenizer):
    """Two sessions send the very same prompt at once: the second waits for
    the first's forward, then copies every prompt token but the last, whose
    logits it computes itself; both replies are plain generate's."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    messages = many_turns(4, 2)
    reports = together(manager, [chat_call(manager, s, messages, 6) for s in ("one", "two")])
    expected = reference_turn(model, tokenizer, messages, 6)[2]
    assert [report.output_ids for report in reports] == [expected, expected]
    assert manager.stats().prefix_tokens_copied == reports[1].prompt_tokens - 1
    manager.close()


def test_raw_ids_stop_strings_grammar_seed_and_penalty_on_grouped_rows(tokenizer):
    """One forward for five prompts: raw ids, a stop string, a grammar, a
    seeded sampled row and a repetition penalty; each is what the same turn
    gives alone (plain generate, or a fresh manager for the seed)."""
    model = model_for("llama")
    grammars = Grammars(
        tokenizer, model.config.vocab_size, end_ids(tokenizer, model.generation_config)
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = grammars.json_schema(schema)
    conversations = [many_turns(k, k % 3 + 1) for k in range(5)]
    raw = render_prompt(tokenizer, conversations[0])
    reply = tokenizer.decode(reference_turn(model, tokenizer, conversations[1], 16)[2])
    # Plain letters the reply reaches midway (a byte-level piece may never match).
    start = next(i for i in range(len(reply) // 3, len(reply)) if reply[i : i + 2].isalpha())
    stop = reply[start : start + 2]
    sampling = dict(do_sample=True, temperature=0.9, top_p=0.95, seed=77)
    alone = SessionManager(model, tokenizer)
    alone.chat("s", conversations[3], max_new_tokens=12, **sampling)
    seeded = alone.last_turn("s").output_ids
    alone.close()

    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    stops = dict(stop_strings=[stop], tokenizer=tokenizer)
    processor = grammars.processor(grammar, "response_format")
    results = together(
        manager,
        [
            generate_call(manager, "raw", raw, 8),
            chat_call(manager, "stop", conversations[1], 16, **stops),
            chat_call(manager, "json", conversations[2], 20, logits_processor=[processor]),
            chat_call(manager, "seed", conversations[3], 12, **sampling),
            chat_call(manager, "penalty", conversations[4], 12, repetition_penalty=1.8),
        ],
    )
    assert results[0] == reference_ids(model, raw, 8)
    expected_stop = reference_turn(model, tokenizer, conversations[1], 16, **stops)[2]
    assert results[1].output_ids == expected_stop and len(expected_stop) < 16
    fresh = grammars.processor(grammar, "response_format")
    expected_json = reference_turn(model, tokenizer, conversations[2], 20, logits_processor=[fresh])
    assert results[2].output_ids == expected_json[2]
    assert expected_json[0].startswith("{")
    assert results[3].output_ids == seeded
    expected_penalty = reference_turn(
        model, tokenizer, conversations[4], 12, repetition_penalty=1.8
    )[2]
    assert results[4].output_ids == expected_penalty
    assert expected_penalty != reference_turn(model, tokenizer, conversations[4], 12)[2]
    assert manager.stats().prompts_prefilled_together == 5
    manager.close()


def test_turns_cancelled_while_their_prompts_wait_to_prefill(tokenizer):
    """Two streams left while their turns wait, grouped with two other turns
    (one cancelled, one closed: ``close`` waits for the commit): each ends at
    its first token, plain generate's; the others are exact, and each left
    session's next turn is exact."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    conversations = [many_turns(k, k + 1) for k in range(4)]
    threads = [
        threading.Thread(target=chat_call(manager, f"s{k}", conversations[k], 8)) for k in (2, 3)
    ]
    with manager._engine.hold():
        streams = {
            name: manager.stream_chat(name, conversations[k], max_new_tokens=30)
            for k, name in enumerate(("cancel", "close"))
        }
        for thread in threads:
            thread.start()
        wait_for(lambda: manager.stats().queued == 4, "every turn queued")
        streams["cancel"].cancel()
        closing = threading.Thread(target=streams["close"].close)
        closing.start()
        wait_for(lambda: streams["close"]._cancel.is_set(), "the close under way")
    closing.join()
    list(streams["cancel"])
    for thread in threads:
        thread.join()
    assert manager.stats().prompts_prefilled_together == 4
    for k, name in enumerate(("cancel", "close")):
        expected = reference_turn(model, tokenizer, conversations[k], 30)[2]
        got = manager.last_turn(name).output_ids
        assert got == expected[:1], name
        reply = tokenizer.decode(got, skip_special_tokens=True)
        after = [*conversations[k], {"role": "assistant", "content": reply}, user_message(5)]
        report = chat_call(manager, name, after, 6)()
        assert report.output_ids == reference_turn(model, tokenizer, after, 6)[2], name
    for k in (2, 3):
        want = reference_turn(model, tokenizer, conversations[k], 8)[2]
        assert manager.last_turn(f"s{k}").output_ids == want
    manager.close()


class FailOnce:
    """Wraps a model's forward (its signature kept) to raise once on the
    first forward over more than one row's prompt: rows side by side, or in
    one sequence under a 4D mask (one_sequence.py). ``failed_mask_ndim``:
    the dimensions of the attention mask the failed forward got."""

    def __init__(self, model):
        self.armed = False
        self.failed_mask_ndim = None
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            grouped = ids is not None and (ids.shape[0] > 1 or getattr(mask, "ndim", 2) == 4)
            if self.armed and grouped:
                self.armed, self.failed_mask_ndim = False, getattr(mask, "ndim", None)
                raise RuntimeError("the grouped forward failed")
            return original(*args, **kwargs)

        model.forward = forward


def test_a_grouped_forward_that_fails_fails_its_turns_and_nothing_else(tokenizer):
    """Two second turns and a first turn that copies their system prompt, in
    one forward that raises: each fails with that error; each session's next
    turn is exact and holds what it reports; an idle session is untouched."""
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    failing = FailOnce(model)
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    conversations = {s: [LONG_SYSTEM, user_message(k)] for k, s in enumerate(["a", "b", "idle"])}
    for session, messages in conversations.items():
        chat_call(manager, session, messages, 5)()
        reply = manager.last_turn(session).output_ids
        text = tokenizer.decode(reply, skip_special_tokens=True)
        messages += [{"role": "assistant", "content": text}, user_message(6)]
    conversations["new"] = [LONG_SYSTEM, user_message(8)]
    idle = manager.info("idle")
    held = {s: manager.info(s).cached_tokens for s in ("a", "b")}
    failing.armed = True
    errors = together(
        manager, [failure_of(chat_call(manager, s, conversations[s], 5)) for s in ("a", "b", "new")]
    )
    assert [str(error) for error in errors] == ["the grouped forward failed"] * 3
    assert not failing.armed and manager.stats().prompts_prefilled_together == 0
    assert manager.info("idle") == idle
    # A failed turn leaves its session its history and no cache (turn.py).
    for session in ("a", "b"):
        assert manager.info(session).cached_tokens == 0 < held[session]
    for session in ("a", "b", "new", "idle"):
        report = chat_call(manager, session, conversations[session], 5)()
        assert report.output_ids == reference_turn(model, tokenizer, conversations[session], 5)[2]
    manager.close()


def int_logits_to_keep(original):
    """A forward that declares ``logits_to_keep`` an int and refuses a tensor."""

    def forward(
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        if not isinstance(logits_to_keep, int):
            raise TypeError(f"logits_to_keep must be an int, got {logits_to_keep!r}")
        return original(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )

    return forward


def no_logits_to_keep(original):
    """A forward without ``logits_to_keep``: logits at every position."""

    def forward(
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        if "logits_to_keep" in kwargs:
            raise TypeError("forward() got an unexpected keyword argument 'logits_to_keep'")
        return original(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

    return forward


def count_only_logits_to_keep(original):
    """A forward that declares ``logits_to_keep`` a tensor, as transformers'
    models do, but slices by a count (older remote code): a tensor of
    positions makes it raise."""

    def forward(
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.numel() > 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return original(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            logits_to_keep=int(logits_to_keep),
            **kwargs,
        )

    return forward


@pytest.mark.parametrize("wrap", [int_logits_to_keep, no_logits_to_keep, count_only_logits_to_keep])
def test_a_forward_that_takes_no_positions_for_logits_to_keep(wrap, tokenizer):
    """A forward whose ``logits_to_keep`` is declared an int (and refuses a
    tensor), that has none, or that declares a tensor but takes only a count:
    grouped prompts (their forward then gives every position's logits) still
    give plain generate's replies, twice: the first turns as one sequence
    (their chat template's head once, one_sequence.py), the second side by
    side."""
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    model.forward = wrap(model.forward)
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    conversations = [many_turns(k, k + 1) for k in range(3)]
    for turn in range(2):
        reports = together(
            manager, [chat_call(manager, f"s{k}", conversations[k], 6) for k in range(3)]
        )
        for k, report in enumerate(reports):
            expected = reference_turn(model, tokenizer, conversations[k], 6)
            assert report.output_ids == expected[2], (turn, k)
            reply = {"role": "assistant", "content": expected[0]}
            conversations[k] = [*conversations[k], reply, user_message(5)]
    stats = manager.stats()
    assert stats.prompts_prefilled_together == 6 and stats.head_tokens_run_once > 0, stats
    manager.close()


def test_padding_positions_stay_within_a_rows_own_positions(tokenizer):
    """GPT-2 learns one embedding per position, up to ``n_positions``. A row
    whose prompt ends one token before that limit, beside a row of 30 new
    tokens: its padding must not take positions past its own (the embedding
    would raise, failing both turns); both replies are plain generate's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=160, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config).to(torch.float64).eval()
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    draw = torch.Generator().manual_seed(0)
    near_the_end = torch.randint(10, 400, (154,), generator=draw)
    out = generate_call(manager, "near", near_the_end, 2)()
    again = torch.cat([near_the_end, torch.tensor(out)])  # 156 tokens, 155 cached
    short = torch.randint(10, 400, (30,), generator=draw)
    got = together(
        manager,
        [generate_call(manager, "near", again, 3), generate_call(manager, "short", short, 3)],
    )
    assert got == [reference_ids(model, again, 3), reference_ids(model, short, 3)]
    assert manager.stats().prompts_prefilled_together == 2
    manager.close()


MIXES = {
    # 44, 231 and 120 new tokens in one forward: their chat template's common
    # head once, as one sequence (engine/one_sequence.py), no padding.
    "lengths": [many_turns(0, 1), many_turns(1, 6), many_turns(2, 3)],
    # A long system prompt computed once, copied into the others.
    "shared": [[LONG_SYSTEM, user_message(k)] for k in range(3)],
    # Both: a copy, and prompts of very different lengths in one forward.
    "mixed": [
        [LONG_SYSTEM, user_message(0)],
        many_turns(1, 1),
        [LONG_SYSTEM, user_message(1), {"role": "assistant", "content": "ok"}, user_message(2)],
    ],
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_first_turns_started_together_are_plain_generates(dtype, mix, tokenizer):
    """test_bfloat16's promise (a first turn is plain generate's reply) for
    first turns whose prompts share forwards and prefixes."""
    model = tiny_model("llama", dtype=dtype, seed=0)
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    conversations = MIXES[mix]
    reports = together(
        manager, [chat_call(manager, f"s{k}", c, 12) for k, c in enumerate(conversations)]
    )
    for report, messages in zip(reports, conversations, strict=True):
        assert report.output_ids == reference_turn(model, tokenizer, messages, 12)[2]
    stats = manager.stats()
    assert stats.prompts_prefilled_together >= 2
    assert (stats.prefix_tokens_copied > 0) == (mix != "lengths")
    manager.close()


@pytest.mark.parametrize("budget", [1, 400_000])
def test_a_budget_the_batch_alone_exceeds(budget, tokenizer):
    """max_cache_bytes below what the batch holds (1 byte), or below the
    sessions plus the batch: turns that copy a prefix and share forwards
    still give plain generate's replies, twice; nothing crashes; the resident
    caches end within the budget and the batch's reservation at zero."""
    model = model_for("llama")
    manager = SessionManager(model, tokenizer, max_step_tokens=1024, max_cache_bytes=budget)
    conversations = {f"s{k}": [LONG_SYSTEM, user_message(k)] for k in range(4)}

    def call(session, messages):
        def run():
            manager.chat(session, messages, max_new_tokens=6, settle=False)
            return manager.last_turn(session)

        return run

    for _ in range(2):
        reports = together(manager, [call(s, m) for s, m in conversations.items()])
        for (session, messages), report in zip(conversations.items(), reports, strict=True):
            expected = reference_turn(model, tokenizer, messages, 6)
            assert report.output_ids == expected[2], session
            reply = {"role": "assistant", "content": expected[0]}
            conversations[session] = [*messages, reply, user_message(9)]
    stats = manager.stats()
    assert stats.prefix_tokens_copied > 0 and stats.prompts_prefilled_together > 0
    assert stats.evictions > 0 and stats.resident_bytes <= budget
    assert stats.batch_bytes == 0 == manager._core.reserved_bytes
    manager.close()


def test_a_prefix_copy_that_fails_fails_only_its_turn(tokenizer, monkeypatch):
    """Copying a prefix allocates (on a GPU it can run out of memory): the
    copy that raises fails its own turn (alone, or grouped), never the
    engine's thread, so the row decoding meanwhile and the turn beside it are
    plain generate's, and the failed session's next turn is exact."""
    from kvchat.engine import loop

    model = model_for("llama")
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    victim = [LONG_SYSTEM, user_message(1)]
    victim_ids = render_prompt(tokenizer, victim).tolist()
    copy = loop.copy_prefix

    def copy_or_run_out(row, donors, minimum=1):
        if row.ids[0].tolist() == victim_ids:
            raise torch.OutOfMemoryError("out of memory copying a prefix")
        return copy(row, donors, minimum)

    monkeypatch.setattr(loop, "copy_prefix", copy_or_run_out)
    decoding = [LONG_SYSTEM, user_message(0)]
    # A reply far longer than the test: it decodes throughout, then is closed.
    endless = dict(max_new_tokens=4000, min_new_tokens=4000)
    stream = manager.stream_chat("decoding", decoding, settle=False, **endless)
    next(stream)
    other = [LONG_SYSTEM, user_message(2)]
    failed = []

    def victim_call():
        try:
            manager.chat("victim", victim, max_new_tokens=6, settle=False)
        except torch.OutOfMemoryError as error:
            failed.append(error)

    victim_call()  # alone beside the decoding row, then beside another turn
    together(manager, [victim_call, chat_call(manager, "other", other, 6)])
    assert manager.stats().batch_rows == 1  # the long reply is still decoding
    stream.close()
    assert [str(error) for error in failed] == ["out of memory copying a prefix"] * 2
    got = manager.last_turn("decoding").output_ids
    prompt = render_prompt(tokenizer, decoding)
    assert got == reference_ids(model, prompt, len(got), min_new_tokens=len(got))
    assert manager.last_turn("other").output_ids == reference_turn(model, tokenizer, other, 6)[2]
    assert manager.stats().prefix_tokens_copied > 0
    monkeypatch.setattr(loop, "copy_prefix", copy)
    report = chat_call(manager, "victim", victim, 6)()
    assert report.output_ids == reference_turn(model, tokenizer, victim, 6)[2]
    manager.close()


def test_a_count_only_forward_given_one_position_is_caught_by_its_shape(tokenizer):
    """Prompts of one length ask for one position, which a forward that
    slices by a count takes as "the last n - 1": logits of another shape,
    caught; the forward runs again for every position's, and each reply is
    plain generate's."""
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    model.forward = count_only_logits_to_keep(model.forward)
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    draw = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 400, (20,), generator=draw) for _ in range(3)]
    got = together(manager, [generate_call(manager, f"s{k}", p, 4) for k, p in enumerate(prompts)])
    assert got == [reference_ids(model, p, 4) for p in prompts]
    assert manager.stats().prompts_prefilled_together == 3
    manager.close()
