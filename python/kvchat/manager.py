"""SessionManager: a drop-in wrapper around a transformers model that keeps each
conversation's KV cache between turns and prefills only what is new."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import torch
from transformers import TextIteratorStreamer

from . import _C
from .cache_bridge import CacheBridge
from .prompting import render_prompt, require_chat_template, turn_markers, validate_messages
from .report import ManagerStats, SessionInfo, TurnReport
from .timing import FirstTokenTimer
from .units import parse_bytes

logger = logging.getLogger("kvchat")


def _check_session_id(session_id) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise TypeError(f"session_id must be a non-empty string, got {session_id!r}")
    return session_id


def _positive_int(value, name: str, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class SessionManager:
    """Keeps one KV cache per conversation for a transformers causal LM.

    Every call is correct whatever the cache holds: a stale, edited or evicted
    history costs time, never correctness.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        max_sessions: int = 16,
        max_cache_bytes: int | str | None = None,
        max_context_length: int | None = None,
    ):
        if not (hasattr(model, "generate") and hasattr(model, "config")):
            raise TypeError(
                f"model must be a transformers causal LM with generate() and config, "
                f"got {type(model).__name__}"
            )
        _positive_int(max_sessions, "max_sessions")
        self._model = model
        self._tokenizer = tokenizer
        self._bridge = CacheBridge(model)
        self._core = _C.SessionManager(
            max_sessions=max_sessions,
            max_cache_bytes=parse_bytes(max_cache_bytes) or 0,
            num_layers=self._bridge.num_layers,
        )
        self._markers = turn_markers(tokenizer, model.generation_config)
        self._rule = _C.RepetitionRule()
        text_config = model.config.get_text_config()
        self._max_context = _positive_int(
            max_context_length, "max_context_length", allow_none=True
        ) or getattr(text_config, "max_position_embeddings", None)

    # ------------------------------------------------------------------ turns
    def chat(
        self,
        session_id: str,
        messages: list[dict[str, str]],
        max_new_tokens: int = 128,
        do_sample: bool = False,
        **generate_kwargs,
    ) -> str:
        """Answers the whole conversation ``messages``; returns the reply text."""
        prompt, messages = self._chat_prompt(session_id, messages)
        kwargs = dict(generate_kwargs, max_new_tokens=max_new_tokens, do_sample=do_sample)
        output = self._turn(session_id, prompt.unsqueeze(0), kwargs, messages=messages)
        return self._decode_reply(output, prompt.numel())

    def stream_chat(
        self,
        session_id: str,
        messages: list[dict[str, str]],
        max_new_tokens: int = 128,
        do_sample: bool = False,
        **generate_kwargs,
    ) -> Iterator[str]:
        """Like chat(), but yields text pieces as they are generated."""
        # Validate now, so bad input raises here rather than at the first next().
        prompt, messages = self._chat_prompt(session_id, messages)
        streamer = TextIteratorStreamer(self._tokenizer, skip_prompt=True, skip_special_tokens=True)
        kwargs = dict(
            generate_kwargs, max_new_tokens=max_new_tokens, do_sample=do_sample, streamer=streamer
        )
        failure: list[BaseException] = []

        def run():
            try:
                self._turn(session_id, prompt.unsqueeze(0), kwargs, messages=messages)
            except BaseException as error:  # re-raised in the consumer's thread
                failure.append(error)
                streamer.end()

        worker = threading.Thread(target=run, name=f"kvchat-stream-{session_id}", daemon=True)
        worker.start()

        def pieces():
            for text in streamer:
                if text:
                    yield text
            worker.join()
            if failure:
                raise failure[0]

        return pieces()

    def generate(self, input_ids: torch.Tensor, session_id: str = "default", **generate_kwargs):
        """Drop-in for ``model.generate``: same arguments, same return value."""
        _check_session_id(session_id)
        if "past_key_values" in generate_kwargs:
            raise ValueError(
                "past_key_values is managed by kvchat; do not pass it to SessionManager.generate"
            )
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a 2-D tensor [batch, tokens], got "
                f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
            )
        if input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        mask = generate_kwargs.get("attention_mask")
        if input_ids.shape[0] != 1 or (mask is not None and not bool(mask.all())):
            # A session is one unpadded conversation; a batch runs as plain generate.
            logger.warning(
                "kvchat: a batch of %d or a padded attention_mask has no session reuse; "
                "running plain generate",
                input_ids.shape[0],
            )
            return self._model.generate(input_ids, **generate_kwargs)
        return self._turn(session_id, input_ids.long(), generate_kwargs)

    # ------------------------------------------------------------ inspection
    def last_turn(self, session_id: str) -> TurnReport | None:
        """What the session's last turn reused, prefilled and generated."""
        record = self._core.find(_check_session_id(session_id)).last_turn()
        return None if record is None else TurnReport.from_core(record)

    def stats(self) -> ManagerStats:
        return ManagerStats.from_core(self._core.stats())

    def info(self, session_id: str) -> SessionInfo:
        return SessionInfo.from_core(self._core.find(_check_session_id(session_id)))

    def sessions(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._core.session_ids())

    def clear(self, session_id: str) -> None:
        """Drops the session's cache and history; keeps its system prompt."""
        self._core.clear(_check_session_id(session_id))

    def remove(self, session_id: str) -> None:
        """Forgets the session entirely."""
        self._core.remove(_check_session_id(session_id))

    @property
    def model(self):
        return self._model

    @property
    def tokenizer(self):
        return self._tokenizer

    # -------------------------------------------------------------- internals
    def _chat_prompt(self, session_id, messages):
        _check_session_id(session_id)
        require_chat_template(self._tokenizer)
        messages = validate_messages(messages)
        return render_prompt(self._tokenizer, messages), messages

    def _decode_reply(self, sequences: torch.Tensor, prompt_tokens: int) -> str:
        return self._tokenizer.decode(sequences[0, prompt_tokens:], skip_special_tokens=True)

    def _check_context(self, prompt_tokens: int, generate_kwargs: dict) -> None:
        if self._max_context is None:
            return
        max_new = generate_kwargs.get("max_new_tokens")
        if max_new is None:
            max_new = self._model.generation_config.max_new_tokens or 0
        if prompt_tokens + max_new > self._max_context:
            raise ValueError(
                f"prompt of {prompt_tokens} tokens plus max_new_tokens={max_new} exceeds "
                f"max_context_length={self._max_context}"
            )

    def _turn(self, session_id, input_ids, generate_kwargs, messages=None):
        """One turn: plan, build the cache, generate, store the cache back."""
        # TTFT counts kvchat's own planning and cache building, as a user sees it.
        timer = FirstTokenTimer()
        prompt = input_ids[0].to("cpu", torch.long).contiguous()
        if prompt.numel() == 0:
            raise ValueError("input_ids must hold at least one token")
        self._check_context(prompt.numel(), generate_kwargs)
        input_ids = input_ids.to(self._model.device)

        kwargs = timer.attach(generate_kwargs)
        # Beam search reorders and widens the cache; it runs without reuse.
        single = max(kwargs.get("num_beams") or 1, kwargs.get("num_return_sequences") or 1) == 1
        reuse = self._bridge.supported and single
        with self._core.acquire(session_id) as session:
            if reuse:
                plan = session.plan(prompt)
                kept, reason = plan.kept_tokens, plan.reason.name
                cache = self._bridge.to_cache(session.layers_for(plan))
            else:
                kept = 0
                reason = "unsupported_layers" if single else "multiple_sequences"
                cache = self._bridge.new_cache()
            output = self._model.generate(input_ids, past_key_values=cache, **kwargs)
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            if reuse:
                self._store(session, sequences[0], cache, kept)
            if messages is not None:
                reply = self._decode_reply(sequences, prompt.numel())
                history = [*messages, {"role": "assistant", "content": reply}]
                session.set_messages([_C.Message(m["role"], m["content"]) for m in history])

            record = _C.TurnRecord()
            record.prompt_tokens = prompt.numel()
            record.reused_tokens = kept
            record.prefilled_tokens = prompt.numel() - kept
            record.output_ids = sequences[0, prompt.numel() :].tolist()
            record.generated_tokens = len(record.output_ids)
            record.prefill_ms = timer.prefill_ms
            record.total_ms = (time.perf_counter() - timer.started) * 1e3
            record.reason = reason
            session.record_turn(record)
        return output

    def _store(self, session, sequence: torch.Tensor, cache, kept: int) -> None:
        """Keeps the post-generation cache, which holds all but the last sampled token."""
        cached = cache.get_seq_length()
        if cached != sequence.numel() - 1:
            # Never store a cache whose ids we cannot name exactly.
            logger.warning(
                "kvchat: cache holds %d tokens for a sequence of %d; dropping it",
                cached,
                sequence.numel(),
            )
            session.invalidate_cache()
            return
        ids = sequence[:cached].to("cpu", torch.long).contiguous()
        session.commit(ids, self._bridge.from_cache(cache), kept, self._markers, self._rule)
