"""SessionManager: a drop-in wrapper around a transformers model that keeps each
conversation's KV cache between turns and prefills only what is new."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import torch

from . import _C
from .arguments import (
    ContextLengthError,
    ManagerOptions,
    check_bool,
    check_path,
    check_session_id,
    choose_tier,
    positive_int,
)
from .cache_bridge import CacheBridge
from .conversation import SendBack, as_dicts, core_messages, drop_oldest_turn
from .fingerprint import model_fingerprint
from .generate_args import resolve_generate_args
from .prefill import ChunkedPrefill
from .prompting import (
    check_template_kwargs,
    check_tools,
    end_ids,
    max_prompt_chars,
    render_text,
    require_chat_template,
    rewritten_tail,
    tokenize_text,
    turn_markers,
    validate_messages,
)
from .report import ManagerStats, SessionInfo, TurnReport
from .settling import Settler, predicted_prefix
from .streaming import ReplyStream
from .tiers.base import StoreUnavailable, Tier
from .tiers.session_file import SessionFileError, read_session, write_session
from .turn import TurnRequest, Turns

logger = logging.getLogger("kvchat")


# Template arguments (tools, chat_template_kwargs) whose rewritten tail is remembered.
_MAX_PROBED_TEMPLATES = 256


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
        match: str = "tokens",
        max_checkpoints: int = 8,
        max_checkpoint_bytes: int | str | None = None,
        checkpoints: str = "last",
        busy: str = "wait",
        overflow: str = "error",
        share_prefixes: bool = True,
        min_shared_tokens: int = 32,
        spill_dir: str | os.PathLike | None = None,
        tier: Tier | None = None,
        isolate_namespaces: bool = False,
        store: str | None = None,
        settle: bool = True,
    ):
        """
        match: "tokens" (exact: the prompt is always a fresh tokenization) or
            "text" (when the new prompt's text extends the cached text, only the
            new suffix is tokenized, so re-tokenized replies still hit; the ids
            can differ from a fresh tokenization).
        max_checkpoints, max_checkpoint_bytes: per session, for models with
            recurrent or sliding-window layers; see docs/hybrid-models.md for the policy.
        checkpoints: where a turn on such a model stops its prefill to take
            a checkpoint (each stop is one more forward over the model).
            "last" (default): at most once, at the final message's start when
            it lies far past the cache's end (on a first turn, the system
            prompt's end); with the free checkpoints at the turn's start and
            the prompt's end, the next turn, an edit of any user message and a
            template that rewrites the last reply all reuse, at a turn's cost
            within a few percent of one forward. "every": at every message
            boundary and before the last prompt token, so a regenerate reuses
            all but one token, for a forward per boundary on every turn. Both
            also stop where a template's generation prompt starts to differ
            from how history renders it (Qwen3.5's "<think>"), found by probing.
        busy: a call on a session another call is using "wait"s its turn, or
            raises ``SessionBusy`` ("error").
        overflow: when prompt + max_new_tokens exceeds max_context_length,
            "error" raises; "truncate" (chat and stream_chat) drops the oldest
            whole turns after the system prompt until it fits.
        share_prefixes: a session with less cached than another resident
            session holds of its prompt starts from that prefix (cut at a
            message boundary, at least ``min_shared_tokens`` long), and the
            sessions then hold it once. Off: every session keeps its own copy.
        spill_dir: a folder where evicted sessions' caches are written; a
            session's next turn reads its file back when the measured load
            time beats the measured prefill time for what it would reuse.
        tier: any other storage tier for evicted sessions (a ``kvchat.Tier``;
            ``spill_dir`` is shorthand for the disk one). One tier per manager.
        store: a ``redis://host:port/db`` URL: session snapshots go to Redis
            after every turn (off the turn's path), and a turn starts from the
            stored one when it covers more of the prompt than this process
            holds, so several processes serve the same conversations. Shorthand
            for ``tier=kvchat.RedisTier(url)``, which takes the settings.
        isolate_namespaces: session ids of the form ``"namespace/name"`` share
            prefixes only within their namespace, so one tenant's turns never
            start from (or reveal) another's cache. ``kvchat serve`` sets it.
        settle: after each chat() or stream_chat() turn, bring the session, in
            the background and only while no turn runs, to the ids its next
            prompt will start with (the history and the reply, rendered by the
            chat template), so that turn prefills only its new messages even
            when the reply re-tokenizes otherwise or the template rewrites it.
            See docs/settling.md. Off with ``match="text"``, which already
            reuses re-tokenized replies.
        """
        if not (hasattr(model, "generate") and hasattr(model, "config")):
            raise TypeError(
                f"model must be a transformers causal LM with generate() and config, "
                f"got {type(model).__name__}"
            )
        options = ManagerOptions.check(
            max_sessions=max_sessions,
            max_cache_bytes=max_cache_bytes,
            max_context_length=max_context_length,
            match=match,
            max_checkpoints=max_checkpoints,
            max_checkpoint_bytes=max_checkpoint_bytes,
            checkpoints=checkpoints,
            busy=busy,
            overflow=overflow,
            share_prefixes=share_prefixes,
            min_shared_tokens=min_shared_tokens,
            isolate_namespaces=isolate_namespaces,
            settle=settle,
        )
        self._truncate, self._wait, self._match = options.truncate, options.wait, options.match
        self._model = model
        self._tokenizer = tokenizer
        # What can fail on a model or tokenizer kvchat cannot read comes before
        # the tier, which may start a writer thread.
        self._bridge = CacheBridge(model)
        self._prefill = ChunkedPrefill(model, self._bridge)
        self._fingerprint = model_fingerprint(model, self._bridge.layer_classes)
        # Given once: the core uses them for every turn's cuts, checkpoints and checks.
        markers = turn_markers(tokenizer, model.generation_config)
        text_config = model.config.get_text_config()
        self._max_context = options.max_context_length or getattr(
            text_config, "max_position_embeddings", None
        )
        self._rewrites: dict[str, int] = {}  # template arguments -> rewritten_tail
        # Removed here, but the shared store could not be told: a retry must
        # still delete it everywhere, though nothing of it is left here.
        self._owed_deletes: set[str] = set()
        self._tier = choose_tier(spill_dir, tier, store)
        self._core = _C.SessionManager(
            max_sessions=options.max_sessions,
            max_cache_bytes=options.max_cache_bytes,
            num_layers=self._bridge.num_layers,
            max_checkpoints=options.max_checkpoints,
            max_checkpoint_bytes=options.max_checkpoint_bytes,
            min_shared_tokens=options.min_shared_tokens,
            keep_evicted=self._tier.keeps_evicted,
            markers=markers,
            repetition=_C.RepetitionRule(),
            prefill_checkpoints=self._bridge.needs_checkpoints,
            placement=options.placement,
            isolate_namespaces=options.isolate_namespaces,
        )
        self._settles = options.settle and self._match == "tokens" and self._bridge.supported
        self._settler = Settler(
            self._core, self._bridge, self._prefill, model.device, self._flush_evicted
        )
        self._tier.isolate_namespaces = options.isolate_namespaces  # stored data stays there
        self._tier.bind(self._fingerprint, self._bridge, model.device)
        self._turns = Turns(self)  # the turn's path: turn.py

    # ------------------------------------------------------------------ turns
    def chat(
        self,
        session_id: str,
        messages: list[dict[str, str]],
        max_new_tokens: int = 128,
        do_sample: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        settle: bool = True,
        **generate_kwargs,
    ) -> str:
        """Answers the whole conversation ``messages``; returns the reply text.

        ``tools`` and ``chat_template_kwargs`` (``{"enable_thinking": False}``,
        say) go to the chat template; the rest goes to ``model.generate``.
        ``settle=False``: do not settle the session for a next turn that sends
        the reply back as returned, because the caller sends something else
        back (tool calls parsed from it, say) and calls ``settle()`` with that."""
        kwargs = dict(generate_kwargs, max_new_tokens=max_new_tokens, do_sample=do_sample)
        request, _ = self._chat_request(
            session_id, messages, tools, chat_template_kwargs, settle, kwargs, streaming=False
        )
        return self._turns.run(request)[1]

    def stream_chat(
        self,
        session_id: str,
        messages: list[dict[str, str]],
        max_new_tokens: int = 128,
        do_sample: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        settle: bool = True,
        skip_special_tokens: bool = True,
        **generate_kwargs,
    ) -> ReplyStream:
        """Like chat(), but yields text pieces as they are generated; once it is
        exhausted or closed, ``stream.report`` is the turn's ``TurnReport``.

        Closing the stream (``close()``, leaving a ``for`` loop over it with
        ``break``, or dropping it) stops generation within a token; the
        session keeps what was generated and stays exact. ``settle``: as in
        chat(). ``skip_special_tokens=False``: pieces keep special tokens (the
        markers of a tool call may be special), except those that end the reply."""
        # Validate now, so bad input raises here rather than at the first next().
        check_bool(skip_special_tokens, "skip_special_tokens")
        kwargs = dict(generate_kwargs, max_new_tokens=max_new_tokens, do_sample=do_sample)
        request, stream = self._chat_request(
            session_id,
            messages,
            tools,
            chat_template_kwargs,
            settle,
            kwargs,
            streaming=True,
            skip_special_tokens=skip_special_tokens,
        )

        def run() -> TurnReport:
            record = self._turns.run(request)[2]
            return TurnReport.from_core(record, self._tier.reload_reason)

        return stream.start(run, name=f"kvchat-stream-{session_id}")

    def generate(self, input_ids: torch.Tensor, session_id: str = "default", **generate_kwargs):
        """Drop-in for ``model.generate``: same arguments, same return value."""
        self._check_ids(input_ids, session_id, generate_kwargs, "generate")
        mask = generate_kwargs.get("attention_mask")
        if input_ids.shape[0] != 1 or (mask is not None and not bool(mask.all())):
            # A session is one unpadded conversation; a batch runs as plain generate.
            logger.warning(
                "kvchat: a batch of %d or a padded attention_mask has no session reuse; "
                "running plain generate",
                input_ids.shape[0],
            )
            return self._model.generate(input_ids, **generate_kwargs)
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids must hold at least one token")
        args = resolve_generate_args(self._model, generate_kwargs, input_ids.shape[1])
        return self._turns.run(TurnRequest(session_id, args, input_ids[0].long()))[0]

    def stream_generate(
        self,
        input_ids: torch.Tensor,
        session_id: str = "default",
        skip_special_tokens: bool = True,
        **generate_kwargs,
    ) -> ReplyStream:
        """generate() for one sequence, streamed as stream_chat() streams: text
        pieces of the continuation, then ``stream.report``. A text completion
        (``kvchat serve``'s ``/v1/completions``) runs here."""
        self._check_ids(input_ids, session_id, generate_kwargs, "stream_generate")
        check_bool(skip_special_tokens, "skip_special_tokens")
        if input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            shape = tuple(input_ids.shape)
            raise ValueError(f"input_ids must be one sequence of at least one token, got {shape}")
        ids = input_ids[0].long()
        max_new = generate_kwargs.get("max_new_tokens")
        if max_new is None:
            max_new = self._model.generation_config.max_new_tokens or 0
        if self._max_context is not None and ids.numel() + max_new > self._max_context:
            raise ContextLengthError(
                f"the prompt ({ids.numel()} tokens) and max_new_tokens ({max_new}) exceed "
                f"max_context_length ({self._max_context})"
            )
        stream = self._reply_stream(generate_kwargs, skip_special_tokens)
        args = resolve_generate_args(self._model, stream.kwargs, ids.numel())
        request = TurnRequest(session_id, args, ids)

        def run() -> TurnReport:
            record = self._turns.run(request)[2]
            return TurnReport.from_core(record, self._tier.reload_reason)

        return stream.start(run, name=f"kvchat-stream-{session_id}")

    def _reply_stream(self, kwargs: dict, skip_special_tokens: bool) -> ReplyStream:
        """The stream a turn's generate kwargs feed; the ids that end the reply
        (this call's eos_token_id, else the model's) are never text."""
        ends = end_ids(self._tokenizer, self._model.generation_config, kwargs.get("eos_token_id"))
        return ReplyStream(self._tokenizer, kwargs, skip_special_tokens, ends)

    @staticmethod
    def _check_ids(input_ids, session_id: str, generate_kwargs: dict, method: str) -> None:
        check_session_id(session_id)
        for name in ("past_key_values", "cache_params", "cache"):
            if name in generate_kwargs:
                raise ValueError(
                    f"{name} is managed by kvchat; do not pass it to SessionManager.{method}"
                )
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a 2-D tensor [batch, tokens], got "
                f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
            )
        if input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")

    def settle(
        self,
        session_id: str,
        messages: list[dict],
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> None:
        """Settles the session for a next turn whose conversation starts with
        ``messages`` (what the caller will send back: the history and the
        reply as it returns it, with parsed ``tool_calls``, say), rendered with
        ``tools`` and ``chat_template_kwargs``. Returns once that is rendered:
        the prefill runs in the background while no turn runs, and replaces
        any settle waiting for this session. Does nothing with ``settle=False``
        or ``match="text"``, or for a session evicted since its turn. Bad
        messages raise here, as in chat() (a history the template refuses, or
        one that leaves no room within ``max_context_length``)."""
        check_session_id(session_id)
        require_chat_template(self._tokenizer)
        messages = validate_messages(messages)
        check_tools(tools)
        check_template_kwargs(chat_template_kwargs, self._tokenizer)
        session = self._core.find(session_id)  # KeyError for an unknown session
        if not self._settles:
            return
        version = session.version  # read first: a turn meanwhile makes the settle moot
        limit = None
        if self._max_context is not None:
            limit = max_prompt_chars(self._tokenizer, self._max_context)
        # Rendered here, so a history the template refuses raises here.
        target = predicted_prefix(self._tokenizer, messages, tools, chat_template_kwargs, limit)
        if target is None:
            return
        if self._max_context is not None and target.numel() >= self._max_context:
            raise ContextLengthError(
                f"messages: the history is {target.numel()} tokens, which leaves no room "
                f"for a next turn within max_context_length={self._max_context}"
            )
        if not session.resident:  # evicted since its turn: nothing to settle from
            return
        self._settler.schedule(session_id, target, version)

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Waits until no settle is waiting or running (a turn meanwhile pauses
        them). False if ``timeout`` ran out first."""
        return self._settler.wait(timeout)

    # ------------------------------------------------------------ inspection
    def last_turn(self, session_id: str) -> TurnReport | None:
        """What the session's last turn reused, prefilled and generated."""
        record = self._core.find(check_session_id(session_id)).last_turn()
        return None if record is None else TurnReport.from_core(record, self._tier.reload_reason)

    def stats(self) -> ManagerStats:
        stats = ManagerStats.from_core(self._core.stats())
        return replace(stats, **self._tier.counters(), **self._settler.counters())

    def info(self, session_id: str) -> SessionInfo:
        return SessionInfo.from_core(self._core.find(check_session_id(session_id)))

    def messages(self, session_id: str) -> list[dict[str, str]]:
        """The session's conversation so far (system prompt first), as chat() takes it."""
        session = self._core.find(check_session_id(session_id))
        return as_dicts(session.messages())

    def sessions(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._core.session_ids())

    def clear(self, session_id: str) -> None:
        """Drops the session's cache and history; keeps its system prompt. With
        a shared store, its snapshot there too (``StoreUnavailable`` if the
        store cannot be reached: cleared here only; call again)."""
        check_session_id(session_id)
        if self._tier.shared and not self._tier.available():
            raise StoreUnavailable(
                f"session {session_id!r} was not cleared: the shared store is unreachable "
                f"(its snapshot there would outlive the clear); try again"
            )
        with self._settler.hold(session_id):
            self._core.clear(session_id)
        self._settler.forget(session_id)
        self._forget_stored(session_id, "cleared")

    def remove(self, session_id: str, local_only: bool = False) -> None:
        """Forgets the session entirely: here and, with a shared store, in the
        store and so on every process that uses it (each drops its copy before
        its next turn). A session only the shared store holds is removed there
        (``KeyError`` if neither holds it). ``local_only``: only in this
        process; a shared store keeps its snapshot for other processes (an idle
        timeout on one server replica wants this).

        With a shared store that cannot be reached, raises ``StoreUnavailable``
        rather than report a delete that other processes would not see: before
        removing anything when the store is known to be down, else after
        removing the copy here (calling again then deletes it there)."""
        check_session_id(session_id)
        everywhere = self._tier.shared and not local_only
        if everywhere and not self._tier.available():
            raise StoreUnavailable(
                f"session {session_id!r} was not removed: the shared store is unreachable "
                f"(other processes would keep serving it); try again"
            )
        try:
            with self._settler.hold(session_id):
                self._core.remove(session_id)
        except KeyError:
            if not everywhere:
                raise
            owed = session_id in self._owed_deletes
            try:
                held = self._tier.forget(session_id, held_here=owed)
            except StoreUnavailable as error:
                raise StoreUnavailable(
                    f"session {session_id!r} is not held here, and the shared store "
                    f"could not be asked to delete it ({error}); try again"
                ) from None
            self._owed_deletes.discard(session_id)
            if not (held or owed):
                raise
            return
        self._settler.forget(session_id)
        if everywhere or not self._tier.shared:
            self._forget_stored(session_id, "removed")
        else:
            self._tier.released(session_id)

    def _forget_stored(self, session_id: str, done: str) -> None:
        try:
            self._tier.forget(session_id)
        except StoreUnavailable as error:
            if done == "removed":
                self._owed_deletes.add(session_id)
            raise StoreUnavailable(
                f"session {session_id!r} was {done} here, but not in the shared store "
                f"({error}); other processes may still serve it: call again"
            ) from None
        self._owed_deletes.discard(session_id)

    def drop_if_deleted(self, session_id: str) -> bool:
        """With a shared store: whether the session was deleted (on any process)
        since its copy here began; if so, removes that copy here (unless a turn
        is running on it, which drops it itself first)."""
        return session_id in self.drop_deleted([check_session_id(session_id)])

    def drop_deleted(self, session_ids: list[str]) -> set[str]:
        """``drop_if_deleted`` for many sessions at once (one store round trip):
        the ids deleted elsewhere, whose copies here are dropped."""
        if not self._tier.shared or not session_ids:
            return set()
        deleted = self._tier.deleted_among(list(session_ids))
        for session_id in deleted:
            try:
                with self._settler.hold(session_id):
                    self._core.remove(session_id)
            except (KeyError, _C.SessionBusy):
                continue
            self._settler.forget(session_id)
            self._tier.released(session_id)
        return deleted

    def flush(self, timeout: float | None = None, session_id: str | None = None) -> bool:
        """Waits until the tier has written every snapshot queued so far (the
        Redis store writes in the background), or only ``session_id``'s.
        False if ``timeout`` ran out."""
        return self._tier.flush(timeout, session_id)

    def close(self) -> None:
        """Stops settling (a settle under way is dropped), writes what the
        tier has queued and stops its writer. The manager should not be used
        afterwards."""
        self._settler.close()
        self._tier.close()

    # ------------------------------------------------------------ persistence
    def save(self, session_id: str, path: str | os.PathLike) -> None:
        """Writes the session (cache, token ids, messages) to a safetensors file.

        The file names the model it came from; ``load`` refuses it for another.
        The write is atomic: an existing file at ``path`` is replaced whole."""
        check_session_id(session_id)
        path = check_path(path)
        # A consistent snapshot under the lease (UnknownSessionError, creating
        # nothing, for an unknown id); stored states are never written in place,
        # so the file is written after it, without blocking the session.
        with (
            self._settler.hold(session_id),
            self._core.acquire(session_id, wait=self._wait, create=False) as session,
        ):
            messages = as_dicts(session.messages())
            state = session.cached_state()
        write_session(path, session_id, messages, state, self._fingerprint, self._bridge.slots)

    def load(self, path: str | os.PathLike, session_id: str | None = None) -> str:
        """Reads a file ``save`` wrote into session ``session_id`` (default: the
        saved id), replacing that session's cache and messages. Returns the id.

        The whole file is checked first (format, model fingerprint, checksum):
        a bad file raises ``SessionFileError`` and changes nothing."""
        if session_id is not None:
            check_session_id(session_id)
        path = check_path(path)
        if not path.is_file():
            raise FileNotFoundError(f"path {str(path)!r} is not a file")
        saved = read_session(path, self._fingerprint, self._model.device, self._bridge)
        try:
            messages = validate_messages(saved.messages) if saved.messages else []
            if saved.state is not None:
                # Checked on a scratch session, so a bad cache never creates or touches `target`.
                _C.ChatSession("load-check", self._bridge.num_layers).restore(saved.state)
        except (TypeError, ValueError, IndexError) as error:
            raise SessionFileError(
                f"path {str(path)!r} holds an invalid session: {error}"
            ) from error
        target = session_id or saved.session_id
        with self._settler.hold(target), self._core.acquire(target, wait=self._wait) as session:
            if saved.state is None:
                session.invalidate_cache()
            else:
                session.restore(saved.state)
            session.set_messages(core_messages(messages))
        self._flush_evicted()
        return target

    def _flush_evicted(self) -> None:
        """Hands what eviction queued to the tier, then lets it go."""
        for session_id, state in self._core.take_evicted():
            self._tier.put(session_id, state)

    @property
    def model(self):
        return self._model

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def tier(self) -> Tier:
        """The storage tier (a ``Tier`` that keeps nothing, if none was given)."""
        return self._tier

    # -------------------------------------------------------------- internals
    def _chat_request(
        self,
        session_id,
        messages,
        tools,
        template_kwargs,
        settle,
        kwargs,
        streaming: bool,
        skip_special_tokens: bool = True,
    ):
        """A chat turn, checked: (its TurnRequest, and for ``streaming`` the
        ReplyStream whose streamer and stop its generate kwargs carry)."""
        text, ids, messages = self._chat_text(
            session_id, messages, kwargs["max_new_tokens"], tools, template_kwargs
        )
        check_bool(settle, "settle")
        stream = self._reply_stream(kwargs, skip_special_tokens) if streaming else None
        args = resolve_generate_args(self._model, stream.kwargs if stream else kwargs, ids.numel())
        tail = self._rewritten_tail(tools, template_kwargs)
        sendback = SendBack(messages, tools, template_kwargs, settle)
        return TurnRequest(session_id, args, ids, text, sendback, rewritten_tail=tail), stream

    def _chat_text(self, session_id, messages, max_new_tokens, tools=None, template_kwargs=None):
        """(prompt text, its token ids, messages), truncated when overflow='truncate'."""
        check_session_id(session_id)
        positive_int(max_new_tokens, "max_new_tokens")
        require_chat_template(self._tokenizer)
        messages = validate_messages(messages)
        check_tools(tools)
        check_template_kwargs(template_kwargs, self._tokenizer)
        # A text longer than this is over the context whatever its tokens:
        # refused before tokenizing, which would cost time and memory for nothing.
        limit = None
        if self._max_context is not None:
            limit = max_prompt_chars(self._tokenizer, self._max_context)

        def render(messages):
            text = render_text(self._tokenizer, messages, tools, template_kwargs)
            if limit is not None and len(text) > limit:
                return text, None
            return text, tokenize_text(self._tokenizer, text)

        def over(ids) -> bool:
            return ids is None or ids.numel() + max_new_tokens > self._max_context

        text, ids = render(messages)
        if self._truncate and self._max_context is not None:
            while over(ids) and (shorter := drop_oldest_turn(messages)):
                messages = shorter
                text, ids = render(messages)
        if ids is None:
            raise ContextLengthError(
                f"prompt of {len(text)} characters (more than {self._max_context} tokens) plus "
                f"max_new_tokens={max_new_tokens} exceeds max_context_length={self._max_context}"
            )
        return text, ids, messages

    def _rewritten_tail(self, tools, template_kwargs) -> int:
        """rewritten_tail() for these template arguments, probed once each:
        only models that take checkpoints need it."""
        if not self._bridge.needs_checkpoints:
            return 0
        key = json.dumps([tools, template_kwargs], sort_keys=True, default=repr)
        if key not in self._rewrites:
            if len(self._rewrites) >= _MAX_PROBED_TEMPLATES:
                self._rewrites.clear()  # a server's clients may send endless tool sets
            self._rewrites[key] = rewritten_tail(self._tokenizer, tools, template_kwargs)
        return self._rewrites[key]
