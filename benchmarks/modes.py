"""The four ways a turn can be served, each timed the same way.

- baseline: plain ``model.generate`` on the whole conversation, no cache kept.
- hf-reuse: what the transformers docs recommend: one ``DynamicCache`` kept per
  conversation and passed back with the full conversation each turn, and a
  ``copy.deepcopy`` of a system-prompt cache to start each conversation.
- kvchat: ``SessionManager.chat``, waiting for the session to settle after
  each turn (the user reads the reply); the settle's time is reported apart.
- limit: one forward over the turn's prompt past the longest common prefix
  with the ids the cache holds (the prompt and reply as generated), on a cache
  already in place, then argmax: the floor for a cache that keeps what the
  model ran. It does not decode. (Layers that cannot crop are rebuilt at the
  common prefix, untimed.) A settled kvchat turn can go under it, since
  settling prefilled the re-rendered history between the turns.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from kvchat import SessionManager
from kvchat.bridge import ForwardArguments
from kvchat.compiled import compile_everywhere
from kvchat.timing import FirstTokenTimer
from memory import PeakMemory, tensor_bytes
from transformers import DynamicCache, NoRepeatNGramLogitsProcessor
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer


@dataclass
class Measured:
    ttft_ms: float
    decode_tps: float | None  # tokens/s after the first; None when the mode does not decode
    prefilled: int
    reused: int
    output_ids: tuple[int, ...]
    held_bytes: int  # cache storage the mode keeps between turns, all sessions
    peak_bytes: int  # held before the call plus the most the call added
    settle_ms: float = 0.0  # kvchat: time settling took after the turn, off its path
    compiles: int = 0  # kvchat: frames torch.compile compiled during the turn


def _cache_tensors(cache: DynamicCache):
    for layer in cache.layers:
        yield from (getattr(layer, "keys", None), getattr(layer, "values", None))


def _decode_tps(new_tokens: int, ttft_ms: float, total_ms: float) -> float | None:
    if new_tokens < 2 or total_ms <= ttft_ms:
        return None
    return (new_tokens - 1) / ((total_ms - ttft_ms) / 1e3)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Mode:
    name = ""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def held_bytes(self) -> int:
        return 0

    def turn(self, session, messages, prompt, generate_kwargs, reference=None) -> Measured:
        raise NotImplementedError

    def sent_back(self, session, history) -> None:
        """The client sends the conversation back as ``history`` (not the
        reply as generated: a tool call it parsed, say)."""

    def _generate(self, prompt, generate_kwargs, **extra):
        """generate with TTFT and total time; returns (new ids, ttft ms, total ms, peak)."""
        held = self.held_bytes()
        timer = FirstTokenTimer()
        with PeakMemory(self.model.device) as peak:
            out = self.model.generate(
                prompt.unsqueeze(0).to(self.model.device), **timer.attach(generate_kwargs), **extra
            )
            _sync(self.model.device)
        total_ms = (time.perf_counter() - timer.started) * 1e3
        new = tuple(out[0, prompt.numel() :].tolist())
        return new, timer.prefill_ms, total_ms, held + peak.extra_bytes


class Baseline(Mode):
    name = "baseline"

    def turn(self, session, messages, prompt, generate_kwargs, reference=None):
        new, ttft, total, peak = self._generate(prompt, generate_kwargs)
        return Measured(ttft, _decode_tps(len(new), ttft, total), prompt.numel(), 0, new, 0, peak)


class StaticCompiled(Mode):
    """Plain generate on the whole conversation, as transformers compiles it:
    ``cache_implementation="static"`` (a StaticCache as long as the turn) and
    its decode compiled, on the CPU too."""

    name = "static+compile"

    def turn(self, session, messages, prompt, generate_kwargs, reference=None):
        new, ttft, total, peak = self._generate(
            prompt,
            generate_kwargs,
            cache_implementation="static",
            compile_config=compile_everywhere(),
        )
        return Measured(ttft, _decode_tps(len(new), ttft, total), prompt.numel(), 0, new, 0, peak)


class HfReuse(Mode):
    name = "hf-reuse"

    def __init__(self, model, tokenizer, system_ids: torch.Tensor):
        super().__init__(model, tokenizer)
        self.system_ids = system_ids
        self.prompt_cache: DynamicCache | None = None
        self.caches: dict[str, DynamicCache] = {}
        self.cache_argument = ForwardArguments(model).cache_name

    def held_bytes(self):
        caches = [*self.caches.values(), *([self.prompt_cache] if self.prompt_cache else [])]
        return tensor_bytes(t for c in caches for t in _cache_tensors(c))

    def turn(self, session, messages, prompt, generate_kwargs, reference=None):
        cache = self.caches.get(session)
        started = time.perf_counter()
        if cache is None:
            # The docs' recipe: a system-prompt cache made once, deep-copied per
            # conversation. Its one-off cost is charged to the turn that made it.
            if self.prompt_cache is None:
                self.prompt_cache = DynamicCache(config=self.model.config)
                with torch.no_grad():
                    self.model(
                        self.system_ids.unsqueeze(0).to(self.model.device),
                        **{self.cache_argument: self.prompt_cache},
                    )
            cache = copy.deepcopy(self.prompt_cache)
        setup_ms = (time.perf_counter() - started) * 1e3
        reused = cache.get_seq_length()
        cache_kwargs = {self.cache_argument: cache}
        new, ttft, total, peak = self._generate(prompt, generate_kwargs, **cache_kwargs)
        self.caches[session] = cache
        ttft, total = ttft + setup_ms, total + setup_ms
        return Measured(
            ttft,
            _decode_tps(len(new), ttft, total),
            prompt.numel() - reused,
            reused,
            new,
            self.held_bytes(),
            peak,
        )


class Kvchat(Mode):
    name = "kvchat"

    def __init__(self, model, tokenizer, sessions: int, name: str = "kvchat", **options):
        super().__init__(model, tokenizer)
        self.name = name
        self.manager = SessionManager(model, tokenizer, max_sessions=max(sessions, 1), **options)

    def held_bytes(self):
        return self.manager.stats().resident_bytes

    def turn(self, session, messages, prompt, generate_kwargs, reference=None):
        held = self.held_bytes()
        compiled = self.manager.stats().compiles
        with PeakMemory(self.model.device) as peak:
            self.manager.chat(session, messages, **generate_kwargs)
            _sync(self.model.device)
        t = self.manager.last_turn(session)
        compiles = self.manager.stats().compiles - compiled
        return Measured(
            t.prefill_ms,
            _decode_tps(t.generated_tokens, t.prefill_ms, t.total_ms),
            t.prefilled_tokens,
            t.reused_tokens,
            t.output_ids,
            self.held_bytes(),
            held + peak.extra_bytes,
            self.settled(),
            compiles,
        )

    def sent_back(self, session, history) -> None:
        self.manager.settle(session, history)  # replaces the settle on the reply

    def settled(self) -> float:
        """Waits for settling (the user reads, or the agent runs its tool);
        the time it spent prefilling since the last call, in ms."""
        self.manager.wait_settled()
        total = self.manager.stats().settle_ms
        spent, self._settle_ms = total - getattr(self, "_settle_ms", 0.0), total
        return spent


class Limit(Mode):
    name = "limit"

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.caches: dict[str, tuple[DynamicCache, torch.Tensor]] = {}
        # Only attention layers crop: for any other (conv, recurrent, a
        # sliding window) the state at the common prefix is rebuilt, untimed.
        # The cache goes by the name the forward declares (``cache`` from
        # transformers 5.24).
        layers = DynamicCache(config=model.config).layers
        self.rebuilds = any(type(layer) is not DynamicLayer for layer in layers)
        self.cache_argument = ForwardArguments(model).cache_name

    def held_bytes(self):
        return tensor_bytes(t for c, _ in self.caches.values() for t in _cache_tensors(c))

    def _forward(self, ids, cache, **extra):
        ids = ids.unsqueeze(0).to(self.model.device)
        return self.model(ids, **{self.cache_argument: cache}, use_cache=True, **extra)

    @torch.no_grad()
    def turn(self, session, messages, prompt, generate_kwargs, reference=None):
        cache, ids = self.caches.get(session, (None, prompt[:0]))
        cache = cache or DynamicCache(config=self.model.config)
        # The cache is "already in place": keep the common prefix (untimed).
        common = int((ids[: prompt.numel()] == prompt[: ids.numel()]).cumprod(0).sum())
        common = min(common, prompt.numel() - 1)
        if common < ids.numel() and self.rebuilds:
            cache = DynamicCache(config=self.model.config)
            if common:
                self._forward(prompt[:common], cache)
        elif common < ids.numel():
            cache.crop(common - ids.numel())
        held = self.held_bytes()
        device = self.model.device
        with PeakMemory(device) as peak:
            started = time.perf_counter()
            logits = self._forward(prompt[common:], cache, logits_to_keep=1)
            scores = logits.logits[0, -1]
            # The same suppressions generate applies, so the first token is comparable.
            banned = list(generate_kwargs.get("suppress_tokens") or [])
            if generate_kwargs.get("min_new_tokens"):
                banned.append(self.tokenizer.eos_token_id)
            scores[banned] = float("-inf")
            if generate_kwargs.get("no_repeat_ngram_size"):
                no_repeat = NoRepeatNGramLogitsProcessor(generate_kwargs["no_repeat_ngram_size"])
                scores = no_repeat(prompt.unsqueeze(0).to(device), scores.unsqueeze(0))[0]
            first = int(scores.argmax())
            _sync(device)
            ttft = (time.perf_counter() - started) * 1e3
        # Bring the cache to where a real one would be after the reply (untimed):
        # every reply token but the last, which is sampled and never forwarded.
        reply = torch.tensor(reference[:-1] if reference else [], dtype=torch.long)
        if reply.numel():
            self._forward(reply, cache)
        self.caches[session] = (cache, torch.cat([prompt, reply]))
        return Measured(
            ttft, None, prompt.numel() - common, common, (first,), self.held_bytes(),
            held + peak.extra_bytes,
        )  # fmt: skip


def recurrent_only(model) -> bool:
    """Whether the model's cache holds recurrent layers alone (Mamba): it can
    neither count nor crop its tokens, so transformers' reuse recipe fails."""
    layers = DynamicCache(config=model.config).layers
    # Exactly the linear-attention class: FalconH1's layer subclasses it and
    # holds attention beside it.
    return all(type(layer) is LinearAttentionLayer for layer in layers)
