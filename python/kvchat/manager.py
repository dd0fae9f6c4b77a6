"""SessionManager: a drop-in wrapper around a transformers model that keeps each
conversation's KV cache between turns and prefills only what is new."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable

import torch
from transformers import CompileConfig

from . import _C
from .arguments import (
    ManagerOptions,
    check_model,
    check_seconds,
    check_session_id,
    check_tokenizer,
    choose_tier,
    reload_reason,
)
from .bridge import CacheBridge
from .bridge.static_cache import SMALLEST_BUCKET
from .compiled import CompiledDecode
from .engine import Engine
from .engine.packed import check_pack_weights
from .engine.prompts import share_scope
from .fingerprint import model_fingerprint
from .prefill import ChunkedPrefill
from .prompting import turn_markers
from .report import TurnReport
from .session_admin import SessionAdmin, evicted_to
from .settling import SETTLE_DELAY_S, Settler
from .streaming import ReplyStream
from .tiers.base import Tier
from .turn import TurnInput, TurnPath
from .turn_requests import RequestBuilder

logger = logging.getLogger("kvchat")


class SessionManager(SessionAdmin):
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
        settle_delay: float = SETTLE_DELAY_S,
        compile: bool | CompileConfig = False,
        max_batch_size: int = 16,
        max_step_tokens: int = 256,
        pack_weights: bool | str = "auto",
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
            message boundary, at least ``min_shared_tokens`` long; in text with
            no boundary, at a multiple of ``min_shared_tokens``), and the
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
            the background and only once no turn has run for ``settle_delay``,
            to the ids its next prompt will start with (the history and the
            reply, rendered by the chat template), so that turn prefills only
            its new messages even when the reply re-tokenizes otherwise or the
            template rewrites it.
            See docs/settling.md. Off with ``match="text"``, which already
            reuses re-tokenized replies.
        settle_delay: seconds without any turn before a settle starts (0.25).
            A next turn sent sooner (an agent with a quick tool) drops the
            settle and prefills its ids in its own forward, rather than
            waiting for the settle's forward to end. ``wait_settled()``
            starts waiting settles at once.
        compile: True (or a ``transformers.CompileConfig``): each turn decodes
            compiled (``torch.compile``; CUDA graphs on a GPU) in a pooled
            ``StaticCache``, on any device. False (default): eagerly, in
            kvchat's growable buffers. ``warm_up()`` compiles before the
            first turn. See docs/compiled-decode.md.
        max_batch_size: at most this many conversations decode in one
            batched step (the engine, docs/ARCHITECTURE.md); more wait for a
            row. max_step_tokens: while others decode, at most this many
            prompt tokens (padding included) are prefilled between two decode
            steps: several short prompts in one forward, a long one in chunks;
            so their streams pause for at most one such forward.
        pack_weights: on a CPU, the engine's forwards run the model's
            ``nn.Linear`` layers through oneDNN on a copy of their weights
            packed once, which makes a decode step over several
            conversations cost about what one conversation's does
            (docs/ARCHITECTURE.md; ``stats().packed_weight_bytes``). "auto"
            (default): float32 weights of at least 2**18 elements, when the
            copy fits in half the memory available; True: every float32
            and bfloat16 (where this CPU's oneDNN has it) linear layer;
            False: none. Never float64, a GPU, ``compile`` or oneDNN turned
            off (``torch.backends.mkldnn``).
            Results differ from the unpacked model's by float rounding;
            your own calls to the model are untouched.
        """
        check_model(model)
        check_tokenizer(tokenizer)
        check_pack_weights(pack_weights)
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
            settle_delay=settle_delay,
            max_batch_size=max_batch_size,
            max_step_tokens=max_step_tokens,
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
        # Removed here, but the shared store could not be told: a retry must
        # still delete it everywhere, though nothing of it is left here.
        self._owed_deletes: set[str] = set()
        self._tier = choose_tier(spill_dir, tier, store)
        self._core = _C.SessionManager(
            *options.core(
                self._bridge.num_layers,
                self._tier.keeps_evicted,
                markers,
                self._bridge.needs_checkpoints,
            )
        )
        self._compiled = CompiledDecode(
            compile, self._bridge.static_problem, getattr(model, "generation_config", None)
        )
        self._settles = options.settle and self._match == "tokens" and self._bridge.supported
        # Not a bound method: the settler and the turns holding the manager
        # would keep it (and its engine's thread and model) alive until a
        # garbage collection, rather than freeing it when its user drops it.
        flush_evicted = evicted_to(self._core, self._tier)
        # Every forward of this model, from any thread, runs on the engine's.
        # The batch's buffers copy the decoding rows' caches: they count in
        # max_cache_bytes, and what evicting for them queues is flushed as
        # after any eviction, when the turns in the batch end.
        self._engine = Engine(
            model,
            self._bridge,
            options.max_batch_size,
            options.max_step_tokens,
            on_batch_bytes=self._core.set_reserved_bytes,
            min_shared_tokens=options.min_shared_tokens,
            pack_weights=pack_weights,
            compiled=self._compiled,
        )
        self._settler = Settler(
            self._core,
            self._bridge,
            self._prefill,
            model.device,
            self._engine,
            flush_evicted,
            options.settle_delay,
        )
        self._tier.isolate_namespaces = options.isolate_namespaces  # stored data stays there
        self._tier.bind(self._fingerprint, self._bridge.layout, model.device)
        self._requests = RequestBuilder(
            model, tokenizer, self._max_context, self._truncate, self._bridge.needs_checkpoints
        )
        self._turns = TurnPath(  # the turn's path: turn.py
            model=model,
            tokenizer=tokenizer,
            core=self._core,
            bridge=self._bridge,
            prefill=self._prefill,
            tier=self._tier,
            settler=self._settler,
            reload_reason=reload_reason(self._tier),  # read once, after bind()
            compiled=self._compiled,
            engine=self._engine,
            flush_evicted=flush_evicted,
            match=self._match,
            wait=self._wait,
            settles=self._settles,
            max_context=self._max_context,
            share_scope=functools.partial(
                share_scope,
                min_shared_tokens=options.min_shared_tokens,
                isolate_namespaces=options.isolate_namespaces,
            ),
        )

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
        request, _ = self._requests.chat(
            session_id, messages, tools, chat_template_kwargs, settle, kwargs, streaming=False
        )
        return self._turns.run(request).reply

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
        kwargs = dict(generate_kwargs, max_new_tokens=max_new_tokens, do_sample=do_sample)
        request, stream = self._requests.chat(
            session_id,
            messages,
            tools,
            chat_template_kwargs,
            settle,
            kwargs,
            streaming=True,
            skip_special_tokens=skip_special_tokens,
        )
        return self._stream(request, stream)

    def generate(self, input_ids: torch.Tensor, session_id: str = "default", **generate_kwargs):
        """Drop-in for ``model.generate``: same arguments, same return value."""
        self._requests.check_ids(input_ids, session_id, generate_kwargs, "generate")
        mask = generate_kwargs.get("attention_mask")
        if input_ids.shape[0] != 1 or (mask is not None and not bool(mask.all())):
            # A session is one unpadded conversation; a batch runs as plain generate.
            logger.warning(
                "kvchat: a batch of %d or a padded attention_mask has no session reuse; "
                "running plain generate",
                input_ids.shape[0],
            )
            return self._engine.run(
                lambda: self._model.generate(input_ids, **generate_kwargs), why="a batch"
            )
        request = self._requests.generate(input_ids, session_id, generate_kwargs)
        return self._turns.run(request).output

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
        request, stream = self._requests.stream_generate(
            input_ids, session_id, skip_special_tokens, generate_kwargs
        )
        return self._stream(request, stream)

    def _stream(self, request: TurnInput, stream: ReplyStream) -> ReplyStream:
        """Starts the turn on the stream's worker; its report once it ends."""

        def run() -> TurnReport:
            record = self._turns.run(request).record
            return TurnReport.from_core(record)

        ender = functools.partial(self._end_turn, request)
        return stream.start(run, name=f"kvchat-stream-{request.session_id}", ender=ender)

    def _end_turn(
        self,
        request: TurnInput,
        stream: ReplyStream,
        messages: list[dict] | None,
        tools: list[dict] | None,
        chat_template_kwargs: dict | None,
        flush_timeout: float | None,
    ) -> TurnReport | None:
        """``stream.end(...)``: see ReplyStream.end."""
        flush_timeout = check_seconds(flush_timeout, "flush_timeout")
        stream.close()
        report = stream.report
        if flush_timeout != 0:  # after the commit: the turn's snapshot is being written
            self.flush(timeout=flush_timeout, session_id=request.session_id)
        if report is None or messages is None:
            return report
        own = request.sendback  # None for a generate turn
        if tools is None and own is not None:
            tools = own.tools
        if chat_template_kwargs is None and own is not None:
            chat_template_kwargs = own.template_kwargs
        try:
            self.settle(request.session_id, messages, tools, chat_template_kwargs)
        except KeyError:  # removed since its turn: nothing to settle
            logger.debug("kvchat: %s was removed before its turn ended", request.session_id)
        return report

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
        the prefill runs in the background once no turn has run for
        ``settle_delay`` (counted from this call at the earliest), and replaces
        any settle waiting for this session. Does nothing with ``settle=False``
        or ``match="text"``, or for a session evicted since its turn. Bad
        messages raise here, as in chat() (a history the template refuses, or
        one that leaves no room within ``max_context_length``)."""
        check_session_id(session_id)
        messages = self._requests.check_conversation(messages, tools, chat_template_kwargs)
        session = self._core.find(session_id)  # KeyError for an unknown session
        if not self._settles or self._turns.plain_only:  # plain turns keep no cache
            return
        version = session.version  # read first: a turn meanwhile makes the settle moot
        target = self._requests.settle_target(messages, tools, chat_template_kwargs)
        if target is not None and session.resident:  # evicted since its turn: nothing to settle
            self._settler.schedule(session_id, target, version)

    def warm_up(self, lengths: int | Iterable[int] = SMALLEST_BUCKET) -> list[int]:
        """Compiles the decode now, off any turn's path, for the capacity
        buckets of ``lengths``: the positions the caller's turns will need,
        prompt plus ``max_new_tokens`` (a bucket's own size names it; see
        docs/compiled-decode.md). The decode batch's step runs for one row
        and for two in each bucket's columns, and in the next bucket up when
        only one is named: two graphs, as rows past one and columns are
        dynamic sizes from the first compile (the other buckets compile
        nothing; on a GPU their CUDA graphs are recorded). A later batched
        turn compiles nothing, in any bucket. Runs on the engine's thread,
        between other work, and returns the buckets it decoded in
        (``warm_up(200)``: ``[256, 512]``). Needs ``compile=True`` (or a ``CompileConfig``):
        ValueError otherwise; on a model whose decode cannot compile it logs
        a warning and returns []."""
        capacities = self._compiled.check_warm_up(lengths, self._max_context)
        return self._compiled.warm_up(self._model, self._bridge, self._engine, capacities)

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Starts every waiting settle at once (without ``settle_delay``) and
        waits until none is waiting or running (a turn meanwhile pauses them).
        False if ``timeout`` (seconds, or None) ran out first."""
        return self._settler.wait(check_seconds(timeout, "timeout"))

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
