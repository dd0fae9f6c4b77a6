"""One conversation's reply as the engine decodes it: a row of the batch.

A turn still calls ``model.generate``, which checks the arguments and builds
the logits processors and stopping criteria exactly as it does for plain
generation. Its decoding loop is kvchat's (``custom_generate``): it hands
them, with the turn's cache, to the engine as a ``DecodeRow`` and waits.
The engine prefills what the cache lacks, then decodes the row beside every
other, and each step does for each row what generate's ``_sample`` does for
a batch of one: the row's processors on its own logits, its own sampling
(with its own ``torch.Generator`` when the request gave a seed), its
streamer, its stopping criteria. So a row's tokens are what plain
``generate`` gives, alone or batched.

What this loop does not carry (the scores or a returned cache asked for, a
padded attention mask, extra model inputs) runs generate's own ``_sample``
on the engine's thread, between steps (``Engine.run``).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from transformers import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerationMixin

from .processors import for_row

# What generate passes its decoding loop that this loop understands.
_KNOWN = {"attention_mask", "position_ids", "logits_to_keep", "use_cache"}


class DecodeRow:
    """The state of one conversation's decoding (engine thread only, once submitted)."""

    def __init__(
        self,
        *,
        cache,
        held: int,
        ids,
        processors,
        criteria,
        do_sample,
        streamer,
        generator=None,
        windows=None,
        stops=(),
        checkpoints=None,
        snapshot=None,
    ):
        self.cache = cache
        self.ids = ids  # [1, tokens]: the prompt, then every token picked
        self.prefilled = held  # prompt tokens the cache holds
        self.length = held  # tokens the cache holds (decoding: all but the last picked)
        self.prompt_tokens = ids.shape[1]
        # Compared with other rows' (engine/prompts.py), by the core, on the CPU.
        self.prompt_ids = ids[0].to("cpu", torch.long).contiguous()
        self.processors, self.criteria = for_row(processors), criteria
        self.do_sample, self.streamer, self.generator = do_sample, streamer, generator
        # A WindowCheckpoints reading the checkpoints off one forward over the
        # prompt's tail (conv windows), or None.
        self.windows = windows
        # Checkpoint positions the prefill stops at; snapshot(cache, position)
        # gives each one's checkpoint, appended to ``checkpoints``.
        self.stops, self.checkpoints, self.snapshot = list(stops), checkpoints, snapshot
        self.share_scope: str | None = None  # whose prefixes it may copy (prompts.py)
        self.slot: int | None = None
        self.joined_length = 0  # tokens its cache held when it joined the batch
        self.submitted = time.perf_counter()
        self.started: float | None = None  # when its first forward ran
        self.eager = False  # a decode step of it ran eagerly in a manager that compiles
        self._done = threading.Event()
        self._error: BaseException | None = None

    @property
    def chunked(self) -> bool:
        """Whether the prompt's tail may be prefilled in several forwards:
        not while its checkpoints are read off one (``windows``)."""
        return self.windows is None

    def stop_reading_windows(self) -> None:
        """The tail is to be prefilled in chunks (rows decode beside it): its
        checkpoints are taken by stopping there instead (bridge/windows.py).
        Before the tail's first forward."""
        self.stops = self.windows.stop()
        self.windows = None

    def pick(self, logits: torch.Tensor) -> bool:
        """generate's ``_sample`` step for this row on its float32 ``logits``
        ``[1, vocab]``; True when the row is finished."""
        scores = self.processors(self.ids, logits)
        if self.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
        else:
            token = torch.argmax(scores, dim=-1)
        self.ids = torch.cat([self.ids, token[:, None]], dim=-1)
        if self.streamer is not None:
            self.streamer.put(token.cpu())
        return bool(self.criteria(self.ids, None).any())

    def finish(self, error: BaseException | None = None, on_success=None) -> None:
        """Ends the row (its streamer's ``end`` first, as generate does) and
        wakes its caller; a streamer whose ``end`` raises fails the turn.
        ``on_success()`` runs before the caller wakes, if it did not fail."""
        try:
            if error is None and self.streamer is not None:
                self.streamer.end()
        except BaseException as raised:  # re-raised on the caller's thread
            error = raised
        finally:
            if error is None and on_success is not None:
                on_success()
            self._error = error
            self._done.set()

    def wait(self) -> torch.Tensor:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self.ids


def decoding_method(
    engine,
    *,
    cache_argument: str,
    streamer,
    held: int,
    windows=None,
    generator=None,
    fallback_context=None,
    stops=(),
    checkpoints=None,
    prefill=None,
    alone: str | None = None,
):
    """A ``custom_generate`` for one turn: its loop runs on ``engine``.
    ``held``: the prompt tokens the cache holds; ``stops``: checkpoint
    positions in the tail, whose checkpoints go to ``checkpoints`` (taken by
    ``prefill``, a ``ChunkedPrefill``); ``windows``: a ``WindowCheckpoints``
    reading them off the tail's one forward instead (the engine stops it,
    and stops at its positions, where it prefills the tail in chunks);
    ``fallback_context``: entered around generate's own loop where the
    engine cannot batch the turn; ``alone``: why it runs that loop alone
    even so."""
    snapshot = None
    if prefill is not None:
        snapshot = prefill.checkpoint

    def kvchat_decode(
        model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs
    ):
        cache = model_kwargs.pop(cache_argument, None)
        mask = model_kwargs.get("attention_mask")
        extra = set(model_kwargs) - _KNOWN
        if alone is not None:
            why = alone
        elif generation_config.return_dict_in_generate:
            why = "return_dict_in_generate"
        elif extra:
            why = f"model inputs {sorted(extra)}"
        elif mask is not None and not bool(mask.all()):
            why = "a padded attention_mask"
        elif cache is None or input_ids.shape[0] != 1:
            why = "no cache" if cache is None else "a batch"
        else:
            why = engine.cannot_batch(cache)
        if why is not None:
            model_kwargs[cache_argument] = cache

            def sample():
                if stops:  # generate's own loop starts after the last stop
                    checkpoints.extend(prefill.run(input_ids, cache, held, list(stops)))
                if generator is not None:
                    torch.manual_seed(generator.initial_seed())
                with fallback_context or contextlib.nullcontext():
                    return GenerationMixin._sample(
                        model,
                        input_ids,
                        logits_processor=logits_processor,
                        stopping_criteria=stopping_criteria,
                        generation_config=generation_config,
                        synced_gpus=False,
                        streamer=streamer,
                        **model_kwargs,
                    )

            return engine.run(sample, why=why)
        row = DecodeRow(
            cache=cache,
            held=held,
            ids=input_ids,
            processors=logits_processor,
            criteria=stopping_criteria,
            do_sample=generation_config.do_sample,
            streamer=streamer,
            generator=generator,
            windows=windows,
            stops=stops,
            checkpoints=checkpoints,
            snapshot=snapshot,
        )
        return engine.decode(row)

    return kvchat_decode


def seeded_generator(seed: int, device) -> torch.Generator:
    """A row's own random numbers: what ``torch.manual_seed(seed)`` would give
    plain generate on ``device``, whatever else the batch samples."""
    return torch.Generator(device=device).manual_seed(seed)


def seeded(seed: int | None, fn):
    """``fn`` (work the engine runs alone) after ``torch.manual_seed(seed)``."""
    if seed is None:
        return fn

    def run():
        torch.manual_seed(seed)
        return fn()

    return run


def stop_strings_as_criteria(model, kwargs: dict) -> dict:
    """generate ``kwargs`` whose stop strings (the call's, or its generation
    config's) come as the ``StopStringCriteria`` generate would build. With a
    ``custom_generate``, generate drops the ``tokenizer`` it needs for them
    (transformers 5.24), and refuses the stop strings."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    strings = kwargs.get("stop_strings", getattr(config, "stop_strings", None))
    if not strings:
        return kwargs
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:  # generate's own error says what is missing
        return kwargs
    criteria = StoppingCriteriaList(
        [*(kwargs.get("stopping_criteria") or []), StopStringCriteria(tokenizer, strings)]
    )
    kwargs = {k: v for k, v in kwargs.items() if k != "tokenizer"}
    return dict(kwargs, stop_strings=None, stopping_criteria=criteria)
