"""Checkpoints of a prompt's uncached tail: where the prefill stops, and the
one taken for free at the prompt's end.

``model.generate`` prefills in one piece, so the state of a recurrent or
sliding layer is only ever seen at the end. For a checkpoint inside the tail
kvchat runs the tail itself up to it, one forward per position, snapshots
there, and then hands the cache to ``generate`` for the rest and decoding.
Every stop costs a forward; the state at the prompt's end costs only a copy,
taken when generate asks for the first token's logits. A model whose only
such state is convolution windows (LFM2) stops nowhere: its checkpoints are
read off generate's own forward (``bridge.windows``).

A cache that cannot count its tokens (recurrent layers alone: Mamba2) would
have ``generate`` run the whole prompt over it again. ``generate`` still gets
the whole prompt, so its logits processors (a repetition penalty, say), its
streamer and its output see what plain ``generate`` sees; ``FeedOnlyTail``
cuts its first forward down to the tokens the cache lacks.
"""

from __future__ import annotations

import inspect

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from . import _C
from .bridge import CacheBridge


class ChunkedPrefill:
    """Runs ``model`` forward over token ranges of one prompt into a cache."""

    def __init__(self, model, bridge: CacheBridge):
        self._model = model
        self._bridge = bridge
        parameters = inspect.signature(model.forward).parameters
        # Only the state matters here; skip the [tokens, vocab] logits.
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}

    @torch.no_grad()
    def run(
        self, input_ids: torch.Tensor, cache, start: int, positions: list[int]
    ) -> list[_C.Checkpoint]:
        """Prefills ``input_ids[:, start:positions[-1]]``; a checkpoint at each position."""
        checkpoints = []
        done = start
        for position in positions:
            if not done < position < input_ids.shape[1]:
                raise ValueError(
                    f"checkpoint positions must rise within ({start}, {input_ids.shape[1]}), "
                    f"got {positions}"
                )
            self.forward(input_ids, cache, done, position)
            done = position
            checkpoints.append(self.checkpoint(cache, position))
        return checkpoints

    def checkpoint(self, cache, position: int) -> _C.Checkpoint:
        """The checkpoint of ``cache``, which holds ``position`` tokens."""
        return _C.Checkpoint(position, self._bridge.snapshot(cache, position))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache, begin: int, end: int) -> None:
        """One forward over ``input_ids[:, begin:end]`` into ``cache``, which holds ``begin``."""
        self._model(
            input_ids=input_ids[:, begin:end],
            use_cache=True,
            **self._bridge.forward_arguments(cache, begin, end, input_ids.device),
            **self._extra,
        )


class PromptEndSnapshot(LogitsProcessor):
    """Snapshots ``cache`` when generate first asks for logits: by then it has
    prefilled the whole prompt of ``tokens`` tokens and decoded nothing, so the
    checkpoint lands at the prompt's end without a forward of its own."""

    def __init__(self, bridge: CacheBridge, cache, tokens: int):
        self._bridge, self._cache, self._tokens = bridge, cache, tokens
        self.checkpoint: _C.Checkpoint | None = None
        self._done = False

    def __call__(self, input_ids, scores):
        if not self._done:
            self._done = True
            # Anything else (a caller's processor that ran a forward) is no
            # prompt end; better no checkpoint than a wrong one.
            # A cache that cannot count its tokens holds what generate fed it.
            knows = self._bridge.knows_length
            holds = not knows or self._cache.get_seq_length() == self._tokens
            if input_ids.shape[-1] == self._tokens and holds:
                states = self._bridge.snapshot(self._cache, self._tokens)
                self.checkpoint = _C.Checkpoint(self._tokens, states)
        return scores

    def attach(self, generate_kwargs: dict) -> dict:
        """generate kwargs with this snapshot first among the processors, so the
        time it takes counts toward the time to first token."""
        processors = LogitsProcessorList([self, *(generate_kwargs.get("logits_processor") or [])])
        return {**generate_kwargs, "logits_processor": processors}


# generate's per-token forward arguments, all shaped [..., prompt tokens] on
# the first forward (cache_position, where given, counts from 0).
_PER_TOKEN = ("input_ids", "attention_mask", "position_ids", "cache_position")


class FeedOnlyTail:
    """While entered, ``model``'s first forward over ``cache`` gets only the
    prompt's tokens after the first ``held``, which the cache already holds.

    A forward over another cache (another session's turn in another thread)
    is left alone, as is every later forward (decoding)."""

    def __init__(self, model, cache, cache_argument: str, prompt_tokens: int, held: int):
        self._model, self._cache, self._argument = model, cache, cache_argument
        self._tokens, self._held = prompt_tokens, held
        self._done = held == 0
        self._handle = None

    def __enter__(self):
        if not self._done:
            self._handle = self._model.register_forward_pre_hook(self._cut, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        if self._handle is not None:
            self._handle.remove()

    def _cut(self, module, args, kwargs):
        if self._done or kwargs.get(self._argument) is not self._cache:
            return None
        self._done = True
        ids = kwargs.get("input_ids")
        if args or ids is None or ids.shape[-1] != self._tokens:
            # Running the whole prompt again over the cache would be wrong.
            raise RuntimeError(
                f"generate's first forward is not over the {self._tokens}-token prompt's ids"
            )
        cut = {
            name: value[..., self._held :]
            for name, value in kwargs.items()
            if name in _PER_TOKEN
            and isinstance(value, torch.Tensor)
            and value.shape[-1] == self._tokens
        }
        return args, {**kwargs, **cut}
