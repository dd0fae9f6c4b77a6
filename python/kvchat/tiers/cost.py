"""When loading a stored cache beats prefilling: the one cost model every tier uses.

Two rates, measured as the manager runs: prefill time per token (from turns)
and load time per byte (from this tier's loads). A load is worth it when its
bytes cost less than prefilling the tokens it adds. Before any prefill was
measured, every load is (the first turns find out what a prefill costs).
"""

from __future__ import annotations

SMOOTHING = 0.3  # weight of the newest measurement in each running rate
MIN_PREFILL_TOKENS = 16  # shorter prefills are dominated by fixed costs


def blend(old: float | None, new: float) -> float:
    """A running rate: ``new`` weighs SMOOTHING against everything before."""
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class ReloadCost:
    """Load-versus-prefill rates of one tier. Updated from any thread without a
    lock: each is one float assignment, and a stale rate costs time, never
    correctness."""

    def __init__(self, default_ms_per_byte: float):
        if not default_ms_per_byte > 0:
            raise ValueError(f"default_ms_per_byte must be > 0, got {default_ms_per_byte!r}")
        self.prefill_ms_per_token: float | None = None
        self.load_ms_per_byte = default_ms_per_byte

    def observe_prefill(self, tokens: int, ms: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS:
            self.prefill_ms_per_token = blend(self.prefill_ms_per_token, ms / tokens)

    def observe_load(self, nbytes: int, ms: float) -> None:
        self.load_ms_per_byte = blend(self.load_ms_per_byte, ms / max(nbytes, 1))

    def worth_loading(self, nbytes: int, tokens: int) -> bool:
        """Whether reading ``nbytes`` beats prefilling the ``tokens`` they add."""
        if self.prefill_ms_per_token is None:
            return True
        return nbytes * self.load_ms_per_byte < tokens * self.prefill_ms_per_token
