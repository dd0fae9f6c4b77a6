"""A row's logits processors, with transformers' minimum-length ones made cheap.

``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``
(``min_length``, ``min_new_tokens``, the server's ``min_tokens``; generate
adds both for ``min_new_tokens``) build a mask over the whole vocabulary
(``arange`` and ``isin``) and clone the scores on every call, also once the
minimum is reached. Once per row per step that cost 19% of the engine's
time with eight conversations on SmolLM2's 49,152-token vocabulary (RESULTS
§27). Here the mask is built once per row and the scores go through
untouched once the minimum is reached: the same scores, every step.
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)


class _MinimumLength:
    """One of the two processors, its end-of-sequence mask built once."""

    def __init__(self, processor):
        self.eos_token_id = processor.eos_token_id
        if type(processor) is MinLengthLogitsProcessor:
            self.skip, self.minimum = 0, processor.min_length
        else:
            self.skip, self.minimum = processor.prompt_length_to_skip, processor.min_new_tokens
        self._mask: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.skip >= self.minimum:
            return scores
        mask = self._mask
        if mask is None or mask.shape[-1] != scores.shape[-1] or mask.device != scores.device:
            vocab = torch.arange(scores.shape[-1], device=scores.device)
            mask = self._mask = torch.isin(vocab, self.eos_token_id.to(scores.device))
        return torch.where(mask, -math.inf, scores)


# Exact types: a subclass may compute otherwise, so it is kept as it is.
_REPLACED = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)


def for_row(processors: LogitsProcessorList | None) -> LogitsProcessorList | None:
    """``processors`` (generate's list) for one row: the same list, or a new
    one where the minimum-length processors are the cheap ones (generate's
    own list is left as it is)."""
    if not processors or not any(type(p) in _REPLACED for p in processors):
        return processors
    return LogitsProcessorList(_MinimumLength(p) if type(p) in _REPLACED else p for p in processors)
