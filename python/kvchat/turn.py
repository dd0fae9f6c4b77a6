"""One turn: the session leased, the core's plan, the model, the core's commit.

``TurnPath.run(TurnInput)`` is the whole path of a turn after the caller has
checked and tokenized its input:

1. pause any settle of the session, lease it, and take over what the settle
   prefilled (see settling.py);
2. drop a copy another process deleted, and ask the tier once for a cache;
3. the core's ``begin_turn``, given the lease, plans what to reuse and returns
   a ``Turn`` (a context manager): leaving its block without ``finish`` aborts
   the turn, so a failure leaves the session with its history and no cache,
   never half a turn;
4. ``_model_run``: build the cache from the plan's layers, prefill to each
   checkpoint (or read the checkpoints off generate's forward, for conv
   windows), run ``generate``, and read the cache back (a ``ModelRun``);
5. ``Turn.finish`` commits it; then the tier gets the turn's snapshot and the
   settler the ids the next prompt is predicted to start with.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from torch._dynamo import exc as dynamo_errors
from transformers import StaticCache

from . import _C
from .arguments import ContextLengthError
from .bridge.windows import WindowCheckpoints
from .conversation import SendBack, as_dicts, core_messages
from .engine import decoding_method, seeded, seeded_generator, stop_strings_as_criteria
from .engine.threads import normal_tensors
from .generate_args import GenerateArgs
from .prediction import predicted_prefix
from .prefill import FeedOnlyTail, PromptEndSnapshot
from .prompting import tokenize_text
from .timing import FirstTokenTimer

logger = logging.getLogger("kvchat")


@dataclass(frozen=True)
class TurnInput:
    """A turn the caller has checked: ``args``, the resolved generate arguments;
    ``fresh``, the prompt's ids (1-D), tokenized once; ``text``, a chat turn's
    prompt text (text mode matches on it); ``sendback``, how a chat turn's
    conversation will come back (None for ``generate()``); ``rewritten_tail``,
    the tokens the template rewrites at the end of its generation prompt."""

    session_id: str
    args: GenerateArgs
    fresh: torch.Tensor
    text: str | None = None
    sendback: SendBack | None = None
    rewritten_tail: int = 0


@dataclass
class ModelRun:
    """The model's half of a turn: what ``generate`` returned, and what the
    core's ``Turn.finish`` takes (see ``result``)."""

    output: object  # generate's output: a tensor or a ModelOutput
    sequence: torch.Tensor  # prompt and generated ids, 1-D, on the CPU
    reply: str | None = None  # a chat turn's reply text
    layers: list = field(default_factory=list)
    cached_tokens: int = 0
    checkpoints: list = field(default_factory=list)
    text: str = ""  # text mode: the text of the cached ids
    messages: list | None = None  # a chat turn's history, reply included
    needed_checkpoint: int = -1  # where the next prompt is predicted to depart
    # The ids the next prompt is predicted to start with, or a function that
    # renders them (on the settle thread), or None.
    settle_to: object = None

    def result(self, timer: FirstTokenTimer) -> _C.TurnResult:
        return _C.TurnResult(
            sequence=self.sequence,
            layers=self.layers,
            cached_tokens=self.cached_tokens,
            checkpoints=self.checkpoints,
            text=self.text,
            messages=self.messages,
            needed_checkpoint=self.needed_checkpoint,
            prefill_ms=timer.prefill_ms,
            total_ms=(time.perf_counter() - timer.started) * 1e3,
        )


@dataclass(frozen=True)
class FinishedTurn:
    """What ``TurnPath.run`` gives back: ``output``, what ``generate`` returned (a
    tensor or a ModelOutput, for ``generate()``); ``reply``, a chat turn's
    reply text (None otherwise); ``record``, the core's ``TurnRecord``."""

    output: object
    reply: str | None
    record: _C.TurnRecord


class TurnPath:
    """The path every turn of one manager takes (its model, core, tier and
    settler): lease, the core's plan, the model, the core's commit."""

    def __init__(
        self,
        *,
        model,
        tokenizer,
        core: _C.SessionManager,
        bridge,
        prefill,
        tier,
        settler,
        reload_reason: _C.ReuseReason,
        compiled,
        engine,
        flush_evicted,
        match: str,
        wait: bool,
        settles: bool,
        max_context: int | None,
        share_scope=lambda session_id: None,
    ):
        """The manager's parts a turn uses; ``flush_evicted`` hands what the
        core evicted to the tier; ``match``, ``wait`` (busy="wait"),
        ``settles`` and ``max_context`` are the manager's options;
        ``reload_reason`` is what a turn from the tier's cache reports;
        ``share_scope(session_id)``: whose prefixes its rows may copy in the
        engine (engine/prompts.py; None: nobody's)."""
        self._model, self._tokenizer, self._core = model, tokenizer, core
        self._bridge, self._prefill, self._tier = bridge, prefill, tier
        self._settler, self._compiled, self._flush_evicted = settler, compiled, flush_evicted
        self._engine = engine  # runs every forward (engine/)
        self._reload_reason = reload_reason
        self._match, self._wait, self._settles = match, wait, settles
        self._max_context = max_context
        self._share_scope = share_scope
        # Why the model's own forward cannot run on kvchat's cache (a user's
        # torch.compile(fullgraph=True) cannot trace it): every turn is plain.
        self._forward_refuses_cache: str | None = None
        # Turns run as plain generate, by why (PLAIN_REASONS), for stats().
        self._plain_turns: dict[str, int] = {}
        self._plain_lock = threading.Lock()

    def counters(self) -> dict:
        """stats()'s count of turns run as plain generate, in all and by why."""
        with self._plain_lock:
            reasons = dict(self._plain_turns)
        return dict(plain_turns=sum(reasons.values()), plain_turn_reasons=reasons)

    def check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if self._max_context is not None and prompt_tokens + max_new_tokens > self._max_context:
            raise ContextLengthError(
                f"prompt of {prompt_tokens} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"max_context_length={self._max_context}"
            )

    @property
    def plain_only(self) -> bool:
        """Whether every turn runs as plain generate: the model's forward
        cannot run on kvchat's cache."""
        return self._forward_refuses_cache is not None

    def run(self, request: TurnInput) -> FinishedTurn:
        if self._engine.on_engine_thread:  # before any lease: it would wait for itself
            raise RuntimeError(
                "a turn was started from the engine's own thread (a streamer, logits "
                "processor or stopping criterion of another turn called the manager); "
                "start it from another thread"
            )
        with normal_tensors():
            try:
                with self._engine.expect(self._share_scope(request.session_id)):
                    return self._run(request)
            except _RunAgain as again:  # refused before its first token: run it plain
                refused = again.forward_refuses
            outcome = self._run(request, refused)
        if self._forward_refuses_cache is None:
            # Plain generate ran that forward: so will every later turn.
            self._forward_refuses_cache = refused
            logger.warning(
                "kvchat: the model's forward cannot run on kvchat's cache (%s); "
                "this manager's turns run as plain generate",
                refused,
            )
        return outcome

    def _run(self, request: TurnInput, refused: str | None = None) -> FinishedTurn:
        """One try at the turn; ``refused``: why it runs as plain generate."""
        session_id, args = request.session_id, request.args
        # Refused before the lease, so a request that cannot fit never waits for one.
        self.check_context(request.fresh.numel(), args.max_new_tokens)
        plain, why = args.plain_reason, args.why
        counted = "generate_args" if plain is not None else None
        if plain is None and not self._bridge.supported:
            plain, counted = _C.ReuseReason.unsupported_layers, "unsupported_layers"
        if plain is None and _autocast_on(self._model):
            # Autocast writes keys and values in different dtypes (rotary
            # embeddings upcast the keys), which a cache cannot hold as one
            # layer; and a cache from outside autocast is not what it computes.
            plain, why = _C.ReuseReason.unsupported_generation, "torch.autocast is on"
            counted = "autocast"
        refused = refused or self._forward_refuses_cache
        if plain is None and refused is not None:
            plain, why = _C.ReuseReason.unsupported_generation, refused
            counted = "forward_refuses_cache"
        if plain is not None and why:
            logger.info("kvchat: %s runs as plain generate (%s)", session_id, why)
        # TTFT counts kvchat's own planning and cache building, as a user sees it.
        timer = FirstTokenTimer()
        kwargs = timer.attach(args.kwargs)
        fresh = request.fresh.to("cpu", torch.long).contiguous()
        snapshot = settle_to = None
        try:
            # The turn takes over a settle of this session (see settling.py).
            with (
                self._settler.hold(session_id, fresh) as handover,
                (lease := self._core.acquire(session_id, wait=self._wait)) as session,
            ):
                self._drop_if_deleted(session)
                # Text mode reads the session's cached text, so it matches under the lease.
                prompt = fresh
                if plain is None:  # a plain turn runs on its own fresh ids
                    prompt = self._text_prompt(session, request.text, fresh)
                if prompt is not fresh:  # text mode's ids differ from the fresh ones
                    self.check_context(prompt.numel(), args.max_new_tokens)
                self._settler.take_over(lease, prompt, handover)  # empties it
                reloaded = self._from_tier(session, prompt) if plain is None else None
                # Leaving this block without finish aborts the turn.
                with self._core.begin_turn(
                    lease,
                    prompt,
                    args.max_new_tokens,
                    reloaded=reloaded,
                    plain=plain,
                    rewritten_tail=request.rewritten_tail,
                    reload_reason=self._reload_reason,
                ) as turn:
                    plan = turn.plan
                    if plan.reload_error:
                        logger.warning(
                            "kvchat: tier's cache for %r does not fit: %s",
                            session_id,
                            plan.reload_error,
                        )
                    run = self._model_run(plan, prompt, kwargs, request, timer)
                    record = turn.finish(run.result(timer))
                writes = self._tier.shared and self._tier.writes_turns  # a SharedTier's
                if writes and not plan.plain and record.cache_stored:
                    # References, not copies: stored states are never written in place.
                    snapshot = (session.cached_state(), as_dicts(session.messages()))
                # A prediction exists only for a chat turn (one with a send-back).
                settles = run.settle_to is not None and self._settles and record.cache_stored
                if settles and request.sendback.settle:
                    settle_to = (run.settle_to, session.version)
            if snapshot is not None:
                self._tier.turn_finished(session_id, *snapshot)
            if settle_to is not None:
                self._settler.schedule(session_id, *settle_to)
            if not plan.plain:
                if not record.cache_stored:
                    logger.warning(
                        "kvchat: the cache after %r's turn does not match its %d tokens; "
                        "dropped it",
                        session_id,
                        prompt.numel() + record.generated_tokens,
                    )
                self._tier.observe_prefill(record.prefilled_tokens, record.prefill_ms)
            if counted is not None:  # a turn that ran, not one refused or failed
                with self._plain_lock:
                    self._plain_turns[counted] = self._plain_turns.get(counted, 0) + 1
            return FinishedTurn(run.output, run.reply, record)
        finally:
            self._flush_evicted()

    def _drop_if_deleted(self, session) -> None:
        """Under the lease: a session deleted on another process (a shared
        store's tombstone) since its copy here began loses that copy (cache and
        history) before this turn, which then starts it anew."""
        if self._tier.shared and self._tier.deleted_since(session.id):
            logger.info("kvchat: session %r was deleted elsewhere; dropped it here", session.id)
            session.invalidate_cache()
            session.set_messages([])

    def _text_prompt(self, session, text: str | None, fresh: torch.Tensor) -> torch.Tensor:
        """In text mode, the cached ids plus the new suffix's when the text extends
        the cached text; otherwise ``fresh``, the prompt's own tokenization."""
        if self._match == "text" and text is not None:
            cached_text = session.cached_text()
            if cached_text and text.startswith(cached_text):
                suffix = tokenize_text(self._tokenizer, text[len(cached_text) :])
                cached = torch.tensor(session.cached_ids(), dtype=torch.long)
                return torch.cat([cached, suffix])
        return fresh

    def _from_tier(self, session, prompt: torch.Tensor):
        """A cache from the tier, or None: asked when the session holds nothing
        here, or for a shared tier (other processes write it) always, saying
        how much of the prompt the session holds here."""
        if not self._tier.shared:
            return None if session.resident else self._tier.find_if_cheaper(session.id, prompt)
        # The core says how much it holds (up to where the prompt departs or
        # its checks stop trusting the cache); ``local`` is references, what
        # the tier need not fetch.
        local = session.cached_state() if session.resident else None
        have = session.held_tokens(prompt)
        return self._tier.find_if_cheaper(session.id, prompt, have=have, local=local)

    def _model_run(self, plan, prompt, kwargs, request: TurnInput, timer) -> ModelRun:
        """The model's part of a turn. A plain plan runs plain generate, passing
        no cache. Otherwise the cache is built from the plan's layers, the
        uncached tail is prefilled to each checkpoint position, and generate
        runs on from there."""
        model_input = prompt.unsqueeze(0).to(self._model.device)
        seed = request.args.seed
        if plan.plain:
            output = self._engine.run(
                seeded(seed, lambda: self._model.generate(model_input, **kwargs)),
                why="plain generate",
            )
            run = ModelRun(output, _sequences(output)[0].to("cpu", torch.long).contiguous())
        else:
            run = self._cached_run(
                plan, model_input, kwargs, request.args.max_new_tokens, timer, seed
            )
        if self._match == "text" and request.text is not None and not plan.plain:
            # The text of the cached ids, for the next turn's prefix match.
            cached_ids = run.sequence[prompt.numel() : run.cached_tokens]
            run.text = request.text + self._tokenizer.decode(cached_ids, skip_special_tokens=False)
        if request.sendback is not None:
            self._send_back(run, plan, prompt.numel(), request.sendback)
        return run

    def _cached_run(
        self, plan, model_input, kwargs, max_new_tokens: int, timer, seed: int | None
    ) -> ModelRun:
        prompt_tokens = model_input.shape[-1]
        bridge = self._bridge
        compile_config = self._compiled.config_for(kwargs)
        batches = self._engine.model_problem is None
        # Decoded by the engine's batch, whose steps the manager's config compiles.
        in_batch = batches and compile_config is not None and self._compiled.batches(kwargs)
        # A turn that turned compiling off decodes alone rather than in that batch.
        alone = (
            "disable_compile"
            if batches and self._compiled.batch_compiles and compile_config is None
            else None
        )
        if in_batch:
            compile_config = None
        if compile_config is None:
            # Consumed: a buffer that moves to a larger arena frees the old one.
            cache = bridge.to_cache(plan.take_layers(), reserve=plan.reserve)
        else:
            capacity = self._compiled.capacity(prompt_tokens + max_new_tokens, self._max_context)
            cache = bridge.to_static_cache(plan.take_layers(), capacity)
            kwargs = dict(kwargs, compile_config=compile_config)
        # Whether the pool gets the cache back: not if the caller got it with
        # generate's output (it is theirs now), nor if compiling failed (the
        # pool is emptied and this manager decodes eagerly from now on).
        pooled = compile_config is not None
        returned = False
        if kwargs.get("streamer") is not None:  # see _PromptHeld
            kwargs = dict(kwargs, streamer=_PromptHeld(kwargs["streamer"]))
        try:
            try:
                if pooled:  # compiling and capturing happen on the engine's thread
                    decode = seeded(seed, lambda: self._run_on(cache, plan, model_input, kwargs))
                    run = self._engine.run(
                        self._compiled.watched(cache.layers_capacity, decode),
                        why="compiled decode",
                    )
                else:
                    run = self._run_on(cache, plan, model_input, kwargs, seed, alone)
            except _DYNAMO_ERRORS as error:
                if timer.first_at is None:
                    # Before the first token: not kvchat's compiled decode
                    # (generate compiles the decode steps) but the model's own
                    # forward. One its user compiled (fullgraph) that cannot
                    # trace the cache (a C++ extension's buffers) runs the turn
                    # again as plain generate, which nothing was streamed or
                    # given to a logits processor before; any other error is
                    # the model's, raised as it is.
                    if isinstance(error, _CANNOT_TRACE):
                        raise _RunAgain(_first_line(error)) from error
                    raise
                if pooled or in_batch:  # kvchat's compiled decode failed
                    pooled = False
                    self._compiled.failed(bridge.static_pool)  # eager from now on
                raise
            if pooled:  # a batched turn is counted by the engine (loop.py _finish)
                self._compiled.record_turn()
            returned = not isinstance(run.output, torch.Tensor) and (
                run.output.get(bridge.cache_argument) is cache
            )
        finally:
            if pooled and not returned:
                bridge.give_back(cache)
        if returned and compile_config is None:
            # The caller may run the returned cache on; the session must not see that.
            bridge.detach_recurrent(cache)
        return run

    def _run_on(
        self, cache, plan, model_input, kwargs, seed: int | None = None, alone: str | None = None
    ) -> ModelRun:
        """Prefills to each checkpoint (or reads them off generate's forward,
        ``WindowCheckpoints``), runs generate on ``cache``, reads it back;
        ``alone``: why the decode must run alone, not in the batch."""
        prompt_tokens = model_input.shape[-1]
        bridge = self._bridge
        positions = plan.checkpoint_positions
        checkpoints = []
        # Where generate's forward starts: after the last stop, if any.
        start = plan.kept_tokens
        windows = contextlib.nullcontext()
        batched = not isinstance(cache, StaticCache)  # decoded by the engine, batched
        stops = []  # where the engine's prefill of the tail stops to take a checkpoint
        if positions and bridge.checkpoints_from_windows and not _chunked(self._model, kwargs):
            windows = bridge.window_checkpoints(cache, start, prompt_tokens, positions)
        elif positions and batched:
            stops = list(positions)
        elif positions:  # a compiled turn: already alone on the engine's thread
            checkpoints = self._engine.run(
                lambda: self._prefill.run(model_input, cache, start, positions)
            )
            start = positions[-1]
        at_end = None
        if plan.snapshot_prompt_end:
            at_end = PromptEndSnapshot(bridge, cache, prompt_tokens)
            kwargs = at_end.attach(kwargs)
        # A cache that cannot count its tokens (recurrent layers alone)
        # must be fed only those it lacks; one that can, generate slices.
        held = 0 if bridge.knows_length else (stops[-1] if stops else start)
        argument = bridge.cache_argument
        feed_only_tail = FeedOnlyTail(self._model, cache, argument, prompt_tokens, held)
        if batched:
            kwargs = dict(
                stop_strings_as_criteria(self._model, kwargs),
                custom_generate=decoding_method(
                    self._engine,
                    cache_argument=argument,
                    streamer=kwargs.get("streamer"),
                    held=start,
                    # The engine stops it where it prefills the tail in chunks.
                    windows=windows if isinstance(windows, WindowCheckpoints) else None,
                    generator=None if seed is None else seeded_generator(seed, model_input.device),
                    # The engine feeds the cache only what it lacks; generate's
                    # own loop, where the engine cannot batch, needs the cut.
                    fallback_context=feed_only_tail,
                    stops=stops,
                    checkpoints=checkpoints,  # filled at each stop
                    prefill=self._prefill,
                    alone=alone,
                ),
            )
            feed_only_tail = contextlib.nullcontext()
        with feed_only_tail, windows:
            output = self._model.generate(model_input, **{argument: cache}, **kwargs)
        if isinstance(windows, WindowCheckpoints) and not windows.stopped:
            try:
                checkpoints, problem = windows.finish()
            except Exception as error:  # a checkpoint never fails a turn
                checkpoints, problem = [], repr(error)
            if problem is not None:
                bridge.windows_failed(problem)
        if at_end is not None and at_end.checkpoint is not None:
            checkpoints.append(at_end.checkpoint)
        sequences = _sequences(output)
        cached = bridge.cached_tokens(cache, sequences.shape[-1])
        return ModelRun(
            output,
            sequences[0].to("cpu", torch.long).contiguous(),
            layers=bridge.from_cache(cache, cached),
            cached_tokens=cached,
            checkpoints=checkpoints,
        )

    def _send_back(self, run: ModelRun, plan, prompt_tokens: int, sendback: SendBack) -> None:
        """A chat turn: the reply, the history with it, and what the next prompt
        is predicted to start with (for settling, and for thinning checkpoints)."""
        run.reply = self._tokenizer.decode(run.sequence[prompt_tokens:], skip_special_tokens=True)
        history = sendback.history(run.reply)
        run.messages = core_messages(history)
        predicts = self._match == "tokens" and self._bridge.supported and not plan.plain
        if not (predicts and (self._settles or self._bridge.needs_checkpoints)):
            return
        predict = functools.partial(
            self._predict, history, sendback.tools, sendback.template_kwargs
        )
        run.settle_to = predict  # rendered by the settle thread
        if self._bridge.needs_checkpoints:
            # Rendered now: where the next prompt departs from what is cached,
            # thinning keeps the checkpoint below it, which settling (or that
            # turn) restores.
            run.settle_to = target = predict()
            if target is not None:
                run.needed_checkpoint = _C.common_prefix_length(target, run.sequence)

    def _predict(self, history, tools, template_kwargs):
        """predicted_prefix, or None (logged) if rendering it fails: a
        prediction is an optimization and never fails a turn."""
        try:
            return predicted_prefix(self._tokenizer, history, tools, template_kwargs)
        except Exception as error:
            logger.warning("kvchat: no settling after this turn: %s", error)
            return None


# What torch.compile raises: its errors, and a fullgraph compile's recompile
# limit, which is no TorchDynamoException (FailOnCacheLimitHit before torch 2.7).
_RECOMPILE_LIMIT = (
    getattr(dynamo_errors, "FailOnRecompileLimitHit", None) or dynamo_errors.FailOnCacheLimitHit
)
_DYNAMO_ERRORS = (dynamo_errors.TorchDynamoException, _RECOMPILE_LIMIT)
# What a fullgraph forward raises where it cannot trace kvchat's cache; not
# a model's own error found while tracing (a shape mismatch), which plain
# generate would raise too.
_CANNOT_TRACE = (dynamo_errors.Unsupported, _RECOMPILE_LIMIT)


class _PromptHeld:
    """A streamer that passes on generate's first ``put`` (the prompt) only
    with the next one (the first token) or ``end``. A cached attempt that
    dynamo refuses at its first forward then leaves the caller's streamer
    untouched, and the plain run again's prompt is the first it sees (a
    streamer that skips the prompt skips its first ``put``)."""

    def __init__(self, streamer):
        self._streamer, self._prompt = streamer, None
        self._first = True

    def put(self, value) -> None:
        if self._first:
            self._first, self._prompt = False, value
            return
        self._release()
        self._streamer.put(value)

    def end(self) -> None:
        self._release()
        self._streamer.end()

    def _release(self) -> None:
        if self._prompt is not None:
            prompt, self._prompt = self._prompt, None
            self._streamer.put(prompt)


class _RunAgain(Exception):
    """The model's forward, compiled by its user, refused kvchat's cache
    before the turn's first token (the ``__cause__``): the turn runs again as
    plain generate; ``forward_refuses`` says why."""

    def __init__(self, forward_refuses: str):
        super().__init__(forward_refuses)
        self.forward_refuses = forward_refuses


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _chunked(model, kwargs: dict) -> bool:
    """Whether generate prefills in chunks (``prefill_chunk_size``), which
    conv windows cannot be read off: a one-token chunk skips LFM2's
    ``update_conv_state``."""
    if "prefill_chunk_size" in kwargs:
        return bool(kwargs["prefill_chunk_size"])
    # A generation_config passed in is completed from the model's own, so
    # either one may set it.
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    return any(getattr(config, "prefill_chunk_size", None) for config in configs)


def _sequences(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.sequences


def _autocast_on(model) -> bool:
    """Whether autocast is on, in this thread, for the model's device."""
    device = getattr(model, "device", None)
    kind = device.type if isinstance(device, torch.device) else "cpu"
    try:
        return torch.is_autocast_enabled(kind)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False
