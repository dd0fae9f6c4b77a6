"""Attacks on hybrid rows copying a prefix in flight up to another row's
checkpoint (engine/prompts.py ``copy_checkpoint``), in float64 unless named:
checkpoints at every message with few kept, a copier that already holds part
of its prompt, identical prompts, copiers prefilled in chunks beside a
decoding row, a donor whose client leaves after its first token, eviction
while rows copy, half precision, and the hybrid families of families.py.
Every reply is its own plain ``generate``'s, and the next turns still are.
An LFM2 row stops at its checkpoints only for a row that would copy one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from families import CONV_WINDOWS, FAMILIES, SHAPE, tiny_from_config
from helpers import LONG_SYSTEM, model_for, reference_turn, user_message
from kvchat import SessionManager
from kvchat.bridge.layout import ATTENTION, RECURRENT, SLIDING
from kvchat.engine.prompts import checkpoint_copies
from kvchat.tiny import tiny_model, tiny_tokenizer
from test_engine import chat_call, together

HYBRIDS = ["lfm2", "qwen3_5", "nemotron_h"]  # conv, DeltaNet, Mamba2 beside attention
SYSTEM_TOKENS = 304  # LONG_SYSTEM's rendered length: where the first turn's checkpoint is


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def assert_exact(manager, model, tokenizer, conversations, new_tokens) -> None:
    for s, messages in conversations.items():
        expected = reference_turn(model, tokenizer, messages, new_tokens[s])[2]
        assert manager.last_turn(s).output_ids == expected, s


def assert_next_turns_exact(manager, model, tokenizer, conversations) -> None:
    """Each session's next turn (reusing what the copy left it) is plain generate's."""
    for s, messages in conversations.items():
        following = [*messages, {"role": "assistant", "content": "Noted."}, user_message(5)]
        reply = manager.chat(s, following, max_new_tokens=4, settle=False)
        assert reply == reference_turn(model, tokenizer, following, 4)[0], s


def shared_system(sessions: str) -> dict:
    return {s: [LONG_SYSTEM, user_message(k)] for k, s in enumerate(sessions)}


def two_copy_the_system_prompt(manager, model, tokenizer) -> None:
    """Three conversations start together on one system prompt: the two
    after the first copy it up to its checkpoint, and every reply and next
    turn is plain generate's."""
    conversations = shared_system("abc")
    together(manager, [chat_call(manager, s, m, 6) for s, m in conversations.items()])
    assert_exact(manager, model, tokenizer, conversations, dict.fromkeys("abc", 6))
    assert manager.stats().prefix_tokens_copied == 2 * SYSTEM_TOKENS, manager.stats()
    assert_next_turns_exact(manager, model, tokenizer, conversations)


@pytest.mark.parametrize("family", HYBRIDS)
def test_every_message_checkpoints_with_two_kept_copy_exactly(family, tokenizer):
    """checkpoints="every" (several stops a row, the donor's at positions the
    copier also stops at) and max_checkpoints=2: the two later rows copy the
    system prompt up to its end and stop on at their own messages; replies
    and next turns are exact."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, checkpoints="every", max_checkpoints=2)
    two_copy_the_system_prompt(manager, model, tokenizer)
    manager.close()


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_a_copier_that_holds_part_of_its_prompt_copies_the_rest(family, tokenizer):
    """A later turn: the copier's own cache holds the system prompt (restored
    from its checkpoint after an edit); the donor, a new session sending the
    same longer history, stops at each message, and the copier copies from
    past its own cache's end up to the donor's checkpoint."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, checkpoints="every", min_shared_tokens=4)
    manager.chat("c", [LONG_SYSTEM, user_message(9)], max_new_tokens=4, settle=False)
    history = [LONG_SYSTEM, user_message(1), {"role": "assistant", "content": "Noted."}]
    conversations = {"d": [*history, user_message(2)], "c": [*history, user_message(3)]}
    together(manager, [chat_call(manager, s, m, 6) for s, m in conversations.items()])
    assert_exact(manager, model, tokenizer, conversations, dict.fromkeys("cd", 6))
    assert manager.last_turn("c").reused_tokens == SYSTEM_TOKENS
    assert manager.stats().prefix_tokens_copied > 0, manager.stats()
    assert_next_turns_exact(manager, model, tokenizer, conversations)
    manager.close()


@pytest.mark.parametrize("family", HYBRIDS)
def test_identical_prompts_copy_up_to_their_last_token(family, tokenizer):
    """Three sessions send the same prompt (min_shared_tokens=1, checkpoints
    at every message): the copies may reach the donor's checkpoint right
    before the last prompt token, whose logits each row computes itself."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, checkpoints="every", min_shared_tokens=1)
    conversations = {s: [LONG_SYSTEM, user_message(3)] for s in "abc"}
    together(manager, [chat_call(manager, s, m, 6) for s, m in conversations.items()])
    assert_exact(manager, model, tokenizer, conversations, dict.fromkeys("abc", 6))
    prompt = manager.last_turn("a").prompt_tokens
    assert 2 * SYSTEM_TOKENS <= manager.stats().prefix_tokens_copied <= 2 * (prompt - 1)
    for s, messages in conversations.items():  # a regenerate reuses all but the last token
        manager.chat(s, messages, max_new_tokens=4, settle=False)
        assert manager.last_turn(s).reused_tokens == prompt - 1, s
        assert manager.last_turn(s).output_ids == reference_turn(model, tokenizer, messages, 4)[2]
    manager.close()


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("checkpoints", ["last", "every"])
def test_copiers_prefill_in_chunks_beside_a_decoding_row(family, checkpoints, tokenizer):
    """A row decodes 40 tokens while three share a system prompt, prefilled
    8 tokens between steps (max_step_tokens=8; LFM2's windows stopped): the
    later two copy up to the first's checkpoint, then prefill in chunks."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, max_step_tokens=8, checkpoints=checkpoints)
    conversations = {"z": [{"role": "system", "content": "Be brief."}, user_message(9)]}
    conversations.update(shared_system("abc"))
    new_tokens = {"z": 40, "a": 6, "b": 6, "c": 6}
    calls = [chat_call(manager, s, m, new_tokens[s]) for s, m in conversations.items()]
    together(manager, calls)
    assert_exact(manager, model, tokenizer, conversations, new_tokens)
    stats = manager.stats()
    assert stats.prefix_tokens_copied == 2 * SYSTEM_TOKENS, stats
    assert stats.prefill_chunks > SYSTEM_TOKENS // 8, stats  # the first row's, in chunks
    assert_next_turns_exact(manager, model, tokenizer, shared_system("abc"))
    manager.close()


@pytest.mark.parametrize("family", ["lfm2", "nemotron_h"])
def test_a_donor_whose_client_leaves_after_its_first_token(family, tokenizer):
    """The first row (whose checkpoint the others would copy) is a stream
    closed after its first token, beside rows decoding (max_step_tokens=8):
    the other two still reply exactly, one copying from the other."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, max_step_tokens=8)
    conversations = shared_system("abc")

    def leaving():
        stream = manager.stream_chat("a", conversations["a"], max_new_tokens=30)
        next(stream)
        stream.close()

    together(manager, [leaving, *(chat_call(manager, s, conversations[s], 6) for s in "bc")])
    assert_exact(manager, model, tokenizer, {s: conversations[s] for s in "bc"}, {"b": 6, "c": 6})
    assert manager.stats().prefix_tokens_copied >= SYSTEM_TOKENS
    assert_next_turns_exact(manager, model, tokenizer, conversations)
    manager.close()


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_eviction_while_rows_copy(family, tokenizer):
    """max_sessions=2 with four turns together, settled (the default): every
    reply is exact, the later three copied the system prompt, and every
    session's next turn (some evicted) is exact."""
    model = model_for(family)
    manager = SessionManager(model, tokenizer, max_sessions=2)
    conversations = shared_system("abcd")
    calls = [
        (lambda s=s: manager.chat(s, conversations[s], max_new_tokens=6)) for s in conversations
    ]
    together(manager, calls)
    assert_exact(manager, model, tokenizer, conversations, dict.fromkeys("abcd", 6))
    stats = manager.stats()
    assert stats.prefix_tokens_copied == 3 * SYSTEM_TOKENS and stats.evictions > 0, stats
    assert_next_turns_exact(manager, model, tokenizer, conversations)
    manager.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_half_precision_copies_give_each_rows_own_tokens(family, dtype, tokenizer):
    """In bfloat16 and float16 a copied prefix is bit for bit what the row's
    own forward to its checkpoint gives: each reply is the one its session
    gets alone in a fresh manager (no copy)."""
    model = tiny_model(family, dtype=dtype)
    conversations = shared_system("abc")
    manager = SessionManager(model, tokenizer)
    together(manager, [chat_call(manager, s, m, 6) for s, m in conversations.items()])
    together_ids = {s: manager.last_turn(s).output_ids for s in conversations}
    assert manager.stats().prefix_tokens_copied == 2 * SYSTEM_TOKENS, manager.stats()
    manager.close()
    for s, messages in conversations.items():
        alone = SessionManager(model, tokenizer)
        alone.chat(s, messages, max_new_tokens=6, settle=False)
        assert together_ids[s] == alone.last_turn(s).output_ids, s
        alone.close()


def _families_model(name, tokenizer):
    if name in CONV_WINDOWS:
        return tiny_from_config(name, torch.float64, CONV_WINDOWS[name], tokenizer)
    model_type, _, fields, _ = FAMILIES[name]
    return tiny_from_config(model_type, torch.float64, dict(SHAPE, **fields), tokenizer)


@pytest.mark.parametrize("name", ["lfm2_moe", "lfm3", "zamba2"])
def test_more_hybrid_families_copy_exactly(name, tokenizer):
    """LFM2-MoE and LFM3 (conv windows) and Zamba2 (Mamba2 layers, and hybrid
    layers of Mamba2 and attention sharing one block's weights): the later
    rows copy, and every reply and next turn is exact."""
    model = _families_model(name, tokenizer)
    manager = SessionManager(model, tokenizer)
    assert checkpoint_copies(manager._bridge.layout)
    two_copy_the_system_prompt(manager, model, tokenizer)
    manager.close()


@pytest.mark.parametrize(
    ("parts", "copies"),
    [
        ([(ATTENTION,), (RECURRENT,)], True),
        ([(ATTENTION, RECURRENT), ()], True),
        ([(SLIDING,), (RECURRENT,)], False),  # a window may have dropped the columns
        ([(ATTENTION,), (SLIDING, RECURRENT)], False),
        ([(ATTENTION,), ()], False),  # attention alone: copy_prefix's
    ],
    ids=["conv", "hybrid-layer", "sliding-beside", "sliding-hybrid", "attention"],
)
def test_no_checkpoint_copy_beside_a_sliding_window(parts, copies):
    """No tiny family puts sliding-window layers beside recurrent ones, so a
    layout stands in: where a window keeps only its last columns, a row must
    not copy columns up to a checkpoint from another row's cache."""
    layout = SimpleNamespace(supported=True, indexed=False, parts=parts)
    assert checkpoint_copies(layout) == copies


def test_an_lfm2_row_reads_its_windows_when_no_row_can_run_beside_it(tokenizer):
    """max_batch_size=1: the rows waiting for the batch start only once the
    first has left, so none can copy from it in flight. Each LFM2 turn then
    reads its checkpoint off its one forward's conv windows, as before the
    copy existed: one forward a prompt, not a second one to stop at a
    checkpoint nobody copies. Replies exact; an edit restores the checkpoint."""
    model = model_for("lfm2")
    manager = SessionManager(model, tokenizer, max_batch_size=1)
    conversations = shared_system("abc")
    together(manager, [chat_call(manager, s, m, 6) for s, m in conversations.items()])
    assert_exact(manager, model, tokenizer, conversations, dict.fromkeys("abc", 6))
    stats = manager.stats()
    assert stats.prefill_chunks == 3 and stats.prefix_tokens_copied == 0, stats
    for s in conversations:
        edited = [LONG_SYSTEM, user_message(40)]
        reply = manager.chat(s, edited, max_new_tokens=6, settle=False)
        assert reply == reference_turn(model, tokenizer, edited, 6)[0], s
        assert manager.last_turn(s).checkpoint_restored == SYSTEM_TOKENS, s
    manager.close()


def test_an_lfm2_row_reads_its_windows_when_its_checkpoint_is_past_what_others_share(
    tokenizer,
):
    """The first LFM2 row sends a history, so its one checkpoint is at its
    last message's start; the second shares only the system prompt with it.
    No checkpoint the first could take lies within what they share, so it
    reads its windows off one forward rather than stopping for the second:
    two forwards in all (max_step_tokens past both prompts: the second's is
    one forward beside the first's decoding), nothing copied, replies exact."""
    model = model_for("lfm2")
    manager = SessionManager(model, tokenizer, max_step_tokens=1024)
    history = [LONG_SYSTEM, user_message(1), {"role": "assistant", "content": "Sure, here."}]
    conversations = {"b": [*history, user_message(2)], "a": [LONG_SYSTEM, user_message(0)]}
    together(manager, [chat_call(manager, s, m, 6) for s, m in conversations.items()])
    assert_exact(manager, model, tokenizer, conversations, dict.fromkeys("ab", 6))
    stats = manager.stats()
    assert stats.prefill_chunks == 2 and stats.prefix_tokens_copied == 0, stats
    manager.close()
