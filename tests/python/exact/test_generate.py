"""SessionManager.generate is a drop-in for model.generate."""

from __future__ import annotations

import torch
from kvchat import SessionManager


def test_same_tensor_return_and_default_session(llama):
    mgr = SessionManager(llama)
    ids = torch.randint(10, 600, (1, 30), generator=torch.Generator().manual_seed(3))
    out = mgr.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, llama.generate(ids, max_new_tokens=6, do_sample=False))
    assert mgr.sessions() == ["default"]


def test_return_dict_in_generate(llama):
    mgr = SessionManager(llama)
    ids = torch.randint(10, 600, (1, 20), generator=torch.Generator().manual_seed(4))
    kwargs = dict(
        max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True
    )
    out = mgr.generate(ids, session_id="d", **kwargs)
    ref = llama.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 5
    # The second turn reuses, and still matches.
    ids2 = torch.cat([out.sequences, ids[:, :7]], dim=1)
    out2 = mgr.generate(ids2, session_id="d", **kwargs)
    assert torch.equal(out2.sequences, llama.generate(ids2, **kwargs).sequences)
    assert mgr.last_turn("d").reused_tokens == out.sequences.shape[1] - 1


def test_attention_mask_of_ones_is_accepted(llama):
    mgr = SessionManager(llama)
    ids = torch.randint(10, 600, (1, 12), generator=torch.Generator().manual_seed(5))
    out = mgr.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(out, llama.generate(ids, max_new_tokens=4, do_sample=False))


def test_batches_run_as_plain_generate(llama, caplog):
    mgr = SessionManager(llama)
    ids = torch.randint(10, 600, (2, 12), generator=torch.Generator().manual_seed(6))
    out = mgr.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, llama.generate(ids, max_new_tokens=4, do_sample=False))
    assert "no session reuse" in caplog.text
    assert mgr.sessions() == []


def test_user_logits_processors_still_apply(llama):
    from transformers import LogitsProcessor, LogitsProcessorList

    class BanToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 100:] = -float("inf")
            return scores

    mgr = SessionManager(llama)
    ids = torch.randint(10, 600, (1, 12), generator=torch.Generator().manual_seed(7))
    procs = LogitsProcessorList([BanToken()])
    out = mgr.generate(ids, max_new_tokens=6, do_sample=False, logits_processor=procs)
    assert (out[0, 12:] < 100).all()
    assert len(procs) == 1  # the caller's list is not modified


def test_beam_search_runs_without_reuse_and_matches(llama):
    mgr = SessionManager(llama)
    ids = torch.randint(10, 600, (1, 12), generator=torch.Generator().manual_seed(9))
    kwargs = dict(max_new_tokens=4, do_sample=False, num_beams=3, num_return_sequences=2)
    for _ in range(2):
        out = mgr.generate(ids, session_id="b", **kwargs)
        assert torch.equal(out, llama.generate(ids, **kwargs))
        assert mgr.last_turn("b").reused_tokens == 0
        assert mgr.last_turn("b").reason == "multiple_sequences"
