"""Checkpoints of a prompt's uncached tail: where the prefill stops, and the
one taken for free at the prompt's end.

``model.generate`` prefills in one piece, so the state of a recurrent or
sliding layer is only ever seen at the end. For a checkpoint inside the tail
kvchat runs the tail itself up to it, one forward per position, snapshots
there, and then hands the cache to ``generate`` for the rest and decoding.
Every stop costs a forward; the state at the prompt's end costs only a copy,
taken when generate asks for the first token's logits.

A cache that cannot count its tokens (recurrent layers alone: Mamba) is
handed to ``generate`` with only the tokens it lacks (``tail_kwargs``), and
the prompt's first tokens are put back in front of what it returns
(``with_prefix``), so the caller sees what plain ``generate`` returns.
"""

from __future__ import annotations

import inspect

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from . import _C
from .cache_bridge import CacheBridge


class ChunkedPrefill:
    """Runs ``model`` forward over token ranges of one prompt into a cache."""

    def __init__(self, model, bridge: CacheBridge):
        self._model = model
        self._bridge = bridge
        parameters = inspect.signature(model.forward).parameters
        # Only the state matters here; skip the [tokens, vocab] logits.
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        # Explicit positions where the model takes them: some (Bamba) count
        # from 0 without them, where generate would pass the true ones. Mamba
        # takes none (its **kwargs would pass them on to its kernels).
        self._positions = "position_ids" in parameters

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
            extra = dict(self._extra)
            if self._positions:
                extra["position_ids"] = torch.arange(done, position, device=input_ids.device)[None]
            self._model(
                input_ids=input_ids[:, done:position],
                use_cache=True,
                **{self._bridge.cache_argument: cache},
                **extra,
            )
            done = position
            checkpoints.append(_C.Checkpoint(position, self._bridge.snapshot(cache, position)))
        return checkpoints


class PromptEndSnapshot(LogitsProcessor):
    """Snapshots ``cache`` when generate first asks for logits: by then it has
    prefilled the whole prompt of ``tokens`` tokens and decoded nothing, so the
    checkpoint lands at the prompt's end without a forward of its own."""

    def __init__(self, bridge: CacheBridge, cache, tokens: int, held: int = 0):
        """``held``: the prompt's first tokens, which generate was not given
        (see ``tail_kwargs``)."""
        self._bridge, self._cache, self._tokens, self._held = bridge, cache, tokens, held
        self.checkpoint: _C.Checkpoint | None = None
        self._done = False

    def __call__(self, input_ids, scores):
        if not self._done:
            self._done = True
            # Anything else (a caller's processor that ran a forward) is no
            # prompt end; better no checkpoint than a wrong one.
            given = self._tokens - self._held
            # What the cache holds; one that cannot count holds what it was fed.
            cached = self._bridge.cached_tokens(self._cache, self._tokens + 1)
            if input_ids.shape[-1] == given and cached == self._tokens:
                states = self._bridge.snapshot(self._cache, self._tokens)
                self.checkpoint = _C.Checkpoint(self._tokens, states)
        return scores

    def attach(self, generate_kwargs: dict) -> dict:
        """generate kwargs with this snapshot first among the processors, so the
        time it takes counts toward the time to first token."""
        processors = LogitsProcessorList([self, *(generate_kwargs.get("logits_processor") or [])])
        return {**generate_kwargs, "logits_processor": processors}


def tail_kwargs(generate_kwargs: dict, held: int) -> dict:
    """generate kwargs for a prompt whose first ``held`` tokens the cache holds
    and generate is not given: an attention mask (all ones, as kvchat takes
    only unpadded prompts) loses those positions too."""
    mask = generate_kwargs.get("attention_mask")
    if mask is None or held == 0:
        return generate_kwargs
    return {**generate_kwargs, "attention_mask": mask[:, held:]}


def with_prefix(output, prefix: torch.Tensor):
    """generate's ``output`` for the tokens after ``prefix``, with ``prefix`` put
    back in front of its sequences: what generate returns for the whole prompt."""
    if prefix.shape[-1] == 0:
        return output
    if isinstance(output, torch.Tensor):
        return torch.cat([prefix.to(output.device), output], dim=-1)
    output.sequences = torch.cat([prefix.to(output.sequences.device), output.sequences], dim=-1)
    return output
