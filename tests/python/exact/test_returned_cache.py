"""A cache handed back by generate(return_dict_in_generate=True) belongs to the
caller: running it on, as transformers' docs show for continuing generation,
never changes the session's next turn."""

from __future__ import annotations

import pytest
import torch
from helpers import LONG_SYSTEM, MAX_NEW, REUSE_FAMILIES, model_for, user_message
from kvchat import SessionManager
from kvchat.prompting import render_prompt


@pytest.mark.parametrize("family", REUSE_FAMILIES)
def test_running_the_returned_cache_on_leaves_the_session_exact(family, tokenizer):
    model = model_for(family)
    mgr = SessionManager(model, tokenizer)
    messages = [LONG_SYSTEM, user_message(0)]
    prompt = render_prompt(tokenizer, messages).unsqueeze(0).to(model.device)
    out = mgr.generate(
        prompt,
        session_id="s",
        max_new_tokens=MAX_NEW,
        do_sample=False,
        return_dict_in_generate=True,
    )
    # Continue on the returned cache for a few tokens, as a caller may.
    cache, sequence = out.past_key_values, out.sequences
    with torch.no_grad():
        for _ in range(3):
            position = torch.tensor([[sequence.shape[1] - 1]], device=model.device)
            logits = model(
                input_ids=sequence[:, -1:], past_key_values=cache, position_ids=position
            ).logits
            sequence = torch.cat([sequence, logits[:, -1:].argmax(-1)], dim=1)

    # The next turn extends the cached ids exactly, so it runs on from the
    # session's own stored state rather than a checkpoint.
    follow_up = render_prompt(tokenizer, [user_message(1)])
    ids = torch.cat([out.sequences, follow_up.unsqueeze(0).to(model.device)], dim=1)
    kwargs = dict(
        max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True, output_logits=True
    )
    got = mgr.generate(ids, session_id="s", **kwargs)
    want = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    # Logits too: a few corrupted tokens of recurrent state move them by 1e-5 to
    # 1e-3 in float64 without always flipping a greedy token; a clean reuse
    # stays within float64 noise, except that Qwen3.5's DeltaNet computes in
    # float32, whose rounding depends on where the prefill was split: up to
    # float32's epsilon, 1.2e-7, measured.
    for ours, theirs in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    report = mgr.last_turn("s")
    assert report.reason == "extend" and report.reused_tokens == out.sequences.shape[1] - 1
