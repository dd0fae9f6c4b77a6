"""Prefill forwards with a mask keep grouped keys grouped, on the engine's
thread, on a CPU.

Why: where a model has fewer key/value heads than query heads (GQA, as
SmolLM2's 3 for 9), transformers' SDPA attention copies every key and value
to each query head (``repeat_kv``) whenever it is given a mask, because
CUDA's fast kernels refuse grouped heads under one. Every prefill over a
cache has a mask (its queries start past position 0), and so does every
forward of prompts prefilled together. On a CPU torch's SDPA takes the
grouped heads under a mask (``enable_gqa``) and gives the same result
without the copies: 10 to 12% of a group of prompts over pasts of 400 tokens
on SmolLM2 (RESULTS §31).

So the engine's thread, on a CPU, answers transformers' question
(``sdpa_attention.use_gqa_in_sdpa``) with yes for a masked forward of more
than one query. Everywhere else (another thread, the user's own calls, a
GPU, a decode step, which transformers already serves by folding the query
heads) the question goes to transformers as before.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("kvchat")

_thread = threading.local()
_INSTALL = threading.Lock()
_original = None  # transformers' own use_gqa_in_sdpa, once installed


def on_this_thread(grouped: bool) -> None:
    """Whether this thread's masked prefills keep grouped keys grouped."""
    _thread.grouped = grouped


def _use_gqa_in_sdpa(attention_mask, key, *args, **kwargs):
    # transformers 5.0 asks with (mask, key), later ones with (mask, key,
    # value): the call goes on to transformers' own as it came.
    value = args[0] if args else kwargs.get("value")
    if (
        attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[-2] > 1  # not a decode step
        and key.device.type == "cpu"
        and (value is None or key.shape[-1] == value.shape[-1])
        and getattr(_thread, "grouped", False)
    ):
        return True
    return _original(attention_mask, key, *args, **kwargs)


def install() -> bool:
    """Puts the engine's answer in front of transformers' (once per process);
    False where this transformers has no such question to answer."""
    global _original
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        return False
    with _INSTALL:
        current = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
        if current is None:
            logger.debug("kvchat: transformers has no use_gqa_in_sdpa; keys repeat under masks")
            return False
        # Wrap transformers' answer once, or again where it was put back; not
        # whatever replaced ours since: a user's wrapper that calls ours would
        # then call itself without end.
        if _original is None or current is _original:
            _original = current
            sdpa_attention.use_gqa_in_sdpa = _use_gqa_in_sdpa
    return True
