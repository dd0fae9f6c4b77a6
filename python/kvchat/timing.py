"""Time to first token, measured inside model.generate."""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList


class FirstTokenTimer(LogitsProcessor):
    """Notes when the first logits arrive, i.e. when prefill has finished."""

    def __init__(self):
        self.started = time.perf_counter()
        self.first_at: float | None = None

    def __call__(self, input_ids, scores):
        if self.first_at is None:
            if scores.is_cuda:
                # The logits are only queued: wait for the prefill to finish. No
                # extra cost, as generate syncs on this token's stopping check anyway.
                torch.cuda.synchronize(scores.device)
            self.first_at = time.perf_counter()
        return scores

    @property
    def prefill_ms(self) -> float:
        """Milliseconds from construction to the first logits (or to now)."""
        return ((self.first_at or time.perf_counter()) - self.started) * 1e3

    def attach(self, generate_kwargs: dict) -> dict:
        """generate kwargs with this timer appended to the caller's processors."""
        processors = LogitsProcessorList([*(generate_kwargs.get("logits_processor") or []), self])
        return {**generate_kwargs, "logits_processor": processors}
