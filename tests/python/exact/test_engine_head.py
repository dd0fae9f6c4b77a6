"""The decode step's output head runs on a multiple of four rows on a CPU in
float32 and float64 (engine/batch.py ``_head_rows_padded``: torch's matrix
product over a vocabulary is slow at 2, 3, 6 and 7 rows there); the padding
never reaches a row's logits, and nothing is left hooked on the model."""

from __future__ import annotations

import pytest
import torch
from helpers import model_for, reference_turn, user_message
from kvchat import SessionManager
from kvchat.tiny import tiny_model, tiny_tokenizer
from test_engine import chat_call, together


@pytest.mark.parametrize("rows", [2, 3])
def test_the_head_sees_four_rows_and_the_replies_stay_exact(rows):
    tokenizer = tiny_tokenizer()
    model = model_for("llama")  # float64 on the CPU
    manager = SessionManager(model, tokenizer)
    head = model.get_output_embeddings()
    heads, forwards = [], []
    head_forward, forward = head.forward, model.forward

    def head_recorded(hidden):  # what the head computes on, its hooks applied
        heads.append(hidden.shape[0])
        return head_forward(hidden)

    def recorded(*args, **kwargs):  # what the engine gets back from each forward
        outputs = forward(*args, **kwargs)
        forwards.append((kwargs["input_ids"].shape, outputs.logits.shape[0]))
        return outputs

    model.forward, head.forward = recorded, head_recorded
    conversations = [
        [{"role": "system", "content": f"Helper {k}."}, user_message(k)] for k in range(rows)
    ]
    try:
        reports = together(
            manager, [chat_call(manager, f"s{k}", conversations[k], 6) for k in range(rows)]
        )
    finally:
        del model.forward, head.forward
    for k, report in enumerate(reports):
        assert report.output_ids == reference_turn(model, tokenizer, conversations[k], 6)[2]
    # Every decode step of several rows (one token each): the head took four
    # rows, and the engine got back one row of logits per conversation.
    assert len(heads) == len(forwards)
    steps = [
        (tuple(shape), logits, took) for (shape, logits), took in zip(forwards, heads, strict=True)
    ]
    batched = [step for step in steps if step[0][1] == 1 and step[0][0] > 1]
    assert any(shape[0] == rows for shape, _, _ in batched), steps
    assert all(took == 4 and logits == shape[0] for shape, logits, took in batched), steps
    assert manager.stats().max_batch_rows == rows
    assert not head._forward_hooks and not head._forward_pre_hooks
    manager.close()


def test_half_precision_and_one_row_run_the_head_as_they_are():
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", dtype=torch.bfloat16)  # its own: the shared ones stay float64
    manager = SessionManager(model, tokenizer)
    head = model.get_output_embeddings()
    seen = []
    handle = head.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    conversations = [[user_message(k)] for k in range(2)]
    try:
        together(manager, [chat_call(manager, f"s{k}", conversations[k], 4) for k in range(2)])
        manager.chat("alone", [user_message(5)], max_new_tokens=4)
    finally:
        handle.remove()
    assert 4 not in seen and 2 in seen and 1 in seen, seen
    manager.close()
