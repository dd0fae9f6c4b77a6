"""The engine: one thread that runs every forward of a manager's model.

Callers (``chat``, ``stream_chat`` and ``generate`` on any thread, the
server's turns, the settler) submit work and wait; the engine's thread loops:

1. a job that must run alone (``run``: plain generate, a compiled turn
   that decodes in a pooled ``StaticCache``, with its own ``compile_config``
   or asking for generate's returned dict, and generate's own loop where a
   turn cannot be batched or turned compiling off beside a compiled batch),
   between steps: the batch waits for its whole length;
2. one batched decode step over every row (``DecodeBatch.step``; in a
   manager that compiles, over static buffers, compiled, which ``warm_up``
   can do ahead), then each row's pick, stream and stop;
3. prefill of the rows still prefilling, at most ``max_step_tokens`` tokens
   between two steps: a long prompt in chunks (a conv-window row's stopping
   at its checkpoints), and on full-attention models several short ones in
   one forward (side by side, padded; or, where they begin alike, as one
   sequence with their common head once: ``one_sequence.py``). A row copies
   a prefix another row holds rather than computing it again
   (``prompts.py``; beside conv, SSM or DeltaNet layers, up to a checkpoint
   the other took). Each row picks its first token (every row of a forward
   before any joins) and then joins the batch. So a long prompt
   never stops the others' streams for longer than a chunk, and a long
   reply never delays a new turn's first token by more than a step;
4. when no row decodes or prefills: idle work (``when_idle``: settling).

Every forward, every CUDA graph capture and every launch happens on this one
thread, so nothing can invalidate a capture. The thread ends when the
manager closes or is dropped (it holds the state, never the ``Engine``), or
at exit, which waits for it (``daemon_threads.py``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from .. import daemon_threads  # first: its hook, which waits for our threads, runs after ours
from ..compiled import ordinary_token
from . import graph_trees, grouped_keys, packed
from .batch import DecodeBatch, unsupported_layer
from .one_sequence import prefill_as_one, sequence_tokens, shared_head, takes_4d_mask
from .prompts import (
    SHARE_MIN_TOKENS,
    LogitsShapeError,
    checkpoint_copies,
    checkpoint_to_copy,
    copy_checkpoint,
    copy_prefix,
    full_attention_only,
    length_dependent_rope,
    logits_to_keep_kind,
    prefill_together,
    waits_for,
    would_copy,
)
from .threads import with_callers_autocast

logger = logging.getLogger("kvchat")

DEFAULT_MAX_BATCH = 16
DEFAULT_MAX_STEP_TOKENS = 256
# How long a prompt may wait, with nothing decoding, for turns that have
# begun but not yet reached the engine (their prompts being rendered, their
# sessions planned), so that prompts arriving together prefill in one forward
# rather than one after another (prompts.py). Counted from the row's submit.
GATHER_S = 0.05
# A group of prompts side by side merges every row's past, left-padded to
# the longest: rows times that length stays under this many columns (a long
# history prefills alone, where its attention is most of the cost anyway).
# As one sequence, the rows' one past does.
GROUP_PAST_COLUMNS = 8192


class _Job:
    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as error:  # re-raised on the caller's thread
            self.error = error
        finally:
            self.done.set()

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class _Loop:
    """The engine's state and its thread's loop (module docstring)."""

    def __init__(self, model, bridge, max_batch: int, max_step_tokens: int, min_shared_tokens: int):
        self.model = model
        self.packs = False  # whether this thread's forwards take packed weights (packed.py)
        # Whether its masked prefills keep grouped keys grouped (grouped_keys.py).
        self.grouped = grouped_keys.install()
        self.release_weights: Callable[[], None] = lambda: None  # PackedWeights.release
        self.check_weights: Callable[[], None] = lambda: None  # PackedWeights.verify
        self.bridge = bridge
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
        self.min_shared_tokens = max(1, min_shared_tokens)
        parameters = inspect.signature(model.forward).parameters
        self._batch_arguments = dict(
            new_cache=bridge.new_cache,
            cache_argument=bridge.cache_argument,
            takes_mask="attention_mask" in parameters,
            takes_positions="position_ids" in parameters,
        )
        self.batch = DecodeBatch(**self._batch_arguments)
        self.step_extra = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        # Whether rows may share prompts (prompts.py): every layer full
        # attention, and a forward that takes each row's mask and positions.
        self.keep_kind = logits_to_keep_kind(parameters)
        self.together = (
            full_attention_only(bridge.layout)
            and "attention_mask" in parameters
            and "position_ids" in parameters
        )
        # Prompts that run together and begin alike run as one sequence, their
        # common head once (one_sequence.py), where the attention takes the 4D
        # mask that needs; others side by side, padded (prompts.py).
        self.as_one = self.together and takes_4d_mask(model)
        # Whether rows copy a prefix in flight up to another's checkpoint
        # (prompts.py): attention beside conv, SSM or DeltaNet layers.
        self.checkpoint_copies = checkpoint_copies(bridge.layout)
        self.cond = threading.Condition()
        self.incoming: collections.deque = collections.deque()  # rows not yet prefilling
        self.prefilling: collections.deque = collections.deque()
        self.jobs: collections.deque = collections.deque()  # run alone, first come first
        self.idle: collections.deque = collections.deque()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.held = 0  # hold(): while positive, no new row starts
        self.expected = 0  # turns begun (Engine.expect) that have not reached the engine
        # Per thread: .pending, its turn is expected; .depth, turns begun in it.
        self.announced = threading.local()
        self.counters = collections.Counter()
        self.queue_wait_s = 0.0
        self.max_rows = 0

    # ------------------------------------------------------------ callers
    def submit(self, queue: collections.deque, item) -> None:
        with self.cond:
            if self.thread is None:  # the first turn, or the first after close()
                if _EXITING.is_set():
                    # A settle handed over after _close_all would start a
                    # thread in the model while the interpreter finalizes
                    # (an abort: daemon_threads.py).
                    raise RuntimeError("the interpreter is exiting: the engine takes no work")
                self.thread = daemon_threads.start(self.work, "kvchat-engine")
                self.closed = False
            queue.append(item)
            self.cond.notify_all()

    def close(self) -> None:
        """Stops the thread (work still queued fails); a later submit starts another."""
        with self.cond:
            thread = self.thread
            if thread is None:
                return
            self.closed = True
            self.cond.notify_all()
        if thread is not threading.current_thread():
            thread.join()

    # ------------------------------------------------------------ the thread
    def work(self) -> None:
        try:
            graph_trees.set_up_engine_thread()
            packed.on_this_thread(self.packs)
            grouped_keys.on_this_thread(self.grouped)
            with torch.no_grad():
                self._serve()
        except BaseException as error:  # a fault here must never leave a caller waiting
            logger.exception("kvchat: the engine's thread failed; its turns fail with it")
            with self.cond:
                self._fail_all(error)
                self.thread = None
        finally:
            graph_trees.before_engine_thread_ends()

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self._has_work() and not self.closed:
                    self.cond.wait()
                if self.closed:
                    self._fail_all(RuntimeError("this SessionManager was closed mid-turn"))
                    self.thread = None
                    return
                # Turns start with no row decoding or prefilling: the user may
                # have changed weights since the last ones (rows that start
                # beside running ones race the model's user anyway).
                starts = not (self.batch.rows or self.prefilling) and bool(
                    self.jobs or (self.incoming and self._room())
                )
                self._take_incoming()
                job = self.jobs.popleft() if self.jobs else None
                idle = None
                if job is None and not (self.batch.rows or self.prefilling) and self.idle:
                    idle = self.idle.popleft()
            if starts and self.packs:
                # Changed where no version counter sees it (packed.py ``verify``).
                try:
                    self.check_weights()
                except Exception:  # no memory for a new copy: unpacked, never stale
                    logger.exception("kvchat: packed weights could not be packed again")
                    self.packs = False
                    packed.on_this_thread(False)
            if job is not None:
                self.counters["jobs_run_alone"] += 1
                job.run()
                continue
            if idle is not None:
                self.counters["idle_jobs"] += 1
                idle.run()
                continue
            if self.batch.rows:
                self._step()
            if self.prefilling or self.batch.rows:
                # Prompts that arrived during the step (or while this thread
                # waited for the GIL) join those waiting, in one forward, and
                # prefill before the next step: else they wait a step and a
                # forward more (RESULTS §29). Not with nothing running: those
                # start at the loop's top, where the weights are checked.
                with self.cond:
                    self._take_incoming()
            # While rows decode, the prompts prefilled between two steps
            # hold at most max_step_tokens tokens: several short ones in one
            # forward, a long one in chunks. With none decoding, the first
            # runs whole, as generate runs it.
            wait = self._gather_wait()
            if wait > 0:
                with self.cond:  # woken by a submit (the loop takes it in) or an arrival
                    self.cond.wait(wait)
                continue
            budget = self.max_step_tokens
            while self.prefilling:
                limit = budget if self.batch.rows else None
                if limit is not None and limit <= 0:
                    break
                group = self._group(limit)
                if not self.prefilling:  # each row left failed (its prefix copy)
                    break
                if len(group) > 1:
                    budget -= self._prefill_group(group)
                    continue
                row = group[0] if group else self.prefilling[0]
                rest = row.prompt_tokens - row.prefilled
                if limit is not None and limit < min(rest, self.max_step_tokens):
                    break  # the rest of this pass's tokens would only cut it short
                done = self._prefill_chunk(row, limit)
                if limit is not None:
                    budget -= done
                if row in self.prefilling:
                    break  # a chunk of a long prompt: the rows decode first

    def _take_incoming(self) -> None:
        """Under ``cond``: submitted rows start prefilling, as many as there is room for."""
        while self.incoming and self._room():
            self.prefilling.append(self.incoming.popleft())

    def _gather_wait(self) -> float:
        """How long the waiting prompts wait for turns that have begun and not
        yet arrived (GATHER_S): only where prompts can share a forward, only
        with no row decoding (a decoding row's next token never waits), and
        only until the oldest waiting row has waited GATHER_S."""
        if not (self.together and self.prefilling and self.expected) or self.batch.rows:
            return 0.0
        oldest = min(row.submitted for row in self.prefilling)
        wait = GATHER_S - (time.perf_counter() - oldest)
        if wait > 0:
            self.counters["gather_waits"] += 1
        return wait

    def _has_work(self) -> bool:
        return bool(
            self.jobs
            or self.batch.rows
            or self.prefilling
            or self.idle
            or (self.incoming and self._room())
        )

    def _room(self) -> bool:
        return not self.held and len(self.batch.rows) + len(self.prefilling) < self.max_batch

    def _drop_batch(self, error: BaseException) -> None:
        """Every decoding row fails with ``error``; none is left to decode
        with the next turn's, and each finishes even if the batch is broken."""
        for row in list(self.batch.rows):
            try:
                if row.slot is not None:
                    self.batch.leave(row, write_back=False)
            except BaseException:
                logger.exception("kvchat: a row could not leave the failed batch")
                self.batch.reset()
            row.finish(error)

    def _fail_all(self, error: BaseException) -> None:
        self._drop_batch(error)
        for row in [*self.prefilling, *self.incoming]:
            row.finish(error)
        self.incoming.clear()
        self.prefilling.clear()
        for job in [*self.jobs, *self.idle]:
            job.error = error
            job.done.set()
        self.jobs.clear()
        self.idle.clear()

    def _step(self) -> None:
        batch = self.batch
        # Whether this step runs compiled (not once a compile failed).
        compiled = batch.static and batch.compiled is not None and batch.compiled.enabled
        try:
            logits = batch.step(self.model, self.step_extra)
        except BaseException as error:  # the forward failed: every row in it fails
            if batch.static and isinstance(error, torch._dynamo.exc.TorchDynamoException):
                batch.compiled.failed(self.bridge.static_pool)  # eager from the next step
            self._drop_batch(error)
            return
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(batch.rows)
        self.max_rows = max(self.max_rows, len(batch.rows))
        for slot, row in enumerate(list(batch.rows)):  # slot: the row's logits
            row.eager = row.eager or not compiled
            try:
                finished = row.pick(logits[slot : slot + 1])
                if finished:
                    batch.leave(row)
                else:
                    batch.set_token(row, row.ids[0, -1])
            except BaseException as error:  # the row's processor, streamer or cache
                if row.slot is not None:
                    batch.leave(row, write_back=False)
                row.finish(error)
                continue
            if finished:
                self._finish(row)

    def _finish(self, row) -> None:
        """Ends a row that decoded to its end. A manager that compiles counts
        it a compiled turn (``compiled_turns``) where none of its steps ran
        eagerly: not a row that decoded on after a compile failed."""
        compiled = self.batch.compiled
        if compiled is not None and compiled.batch_compiles and not row.eager:
            row.finish(on_success=compiled.record_turn)  # counted before its caller wakes
        else:
            row.finish()

    def warm_up(self, compiled, columns: int, rows: int, tokens: int, steps: int) -> None:
        """Compiles the batch step for ``rows`` rows in ``columns`` columns:
        a batch of its own (the live one is left alone), of rows holding the
        same ``tokens`` ordinary tokens, decoding ``steps`` steps."""
        cache = self.bridge.new_cache()
        ids = torch.full((1, tokens), ordinary_token(self.model), device=self.model.device)
        self.model(input_ids=ids, use_cache=True, **{self.bridge.cache_argument: cache})
        batch = DecodeBatch(**self._batch_arguments)
        batch.compiled = compiled
        batch.shape(cache, rows, columns, tokens)
        warm = [_WarmRow(cache, ids) for _ in range(rows)]
        try:
            for row in warm:
                batch.join(row)
            for _ in range(steps):
                batch.step(self.model, self.step_extra)
        finally:
            batch.reset()

    def _prefill_chunk(self, row, budget: int | None) -> int:
        """Prefills ``row``'s prompt up to ``budget`` tokens more (None: to its
        end, in one forward, as generate runs it); returns the tokens run."""
        self._start(row)
        try:
            if self.checkpoint_copies:
                self._copy_checkpoint(row)
            begin, end = row.prefilled, row.prompt_tokens
            if not row.chunked and budget is not None and end - begin > budget:
                # Its checkpoints would come off one forward over the tail
                # (conv windows), longer than rows decoding may wait for: it
                # goes in chunks, stopping at each checkpoint instead.
                row.stop_reading_windows()
        except BaseException as error:
            self.prefilling.remove(row)
            row.finish(error)
            return 0
        stop = next((p for p in row.stops if p > begin), None)
        if stop is not None:  # a checkpoint's position ends a forward
            end = min(end, stop)
        if row.chunked and budget is not None:
            end = min(end, row.prefilled + budget)
        try:
            kwargs = self.bridge.forward_arguments(row.cache, row.prefilled, end, row.ids.device)
            outputs = self.model(
                input_ids=row.ids[:, row.prefilled : end],
                use_cache=True,
                return_dict=True,
                **kwargs,
                **self.step_extra,
            )
            self.counters["prefill_chunks"] += 1
            row.prefilled = row.length = end
            if end == stop:
                row.checkpoints.append(row.snapshot(row.cache, end))
            if end < row.prompt_tokens:
                return end - begin
            self.prefilling.remove(row)
            logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
            del outputs
            if row.pick(logits):
                self._finish(row)
            else:
                self.batch.join(row)
        except BaseException as error:
            if row in self.prefilling:
                self.prefilling.remove(row)
            if row.slot is not None:
                self.batch.leave(row, write_back=False)
            row.finish(error)
        return end - begin

    def _copy_checkpoint(self, row) -> None:
        """Before a forward of ``row``'s prompt, on a model with conv, SSM or
        DeltaNet layers (prompts.py ``copy_checkpoint``): copies a prefix
        up to another row's checkpoint; and, if a row still to prefill would
        copy up to one of this row's checkpoints, makes it take them by
        stopping at them (not off conv windows, which only its turn reads,
        once it ends), so that it can."""
        donors = [*self.batch.rows, *self.prefilling]
        found = checkpoint_to_copy(row, donors, self.min_shared_tokens)
        if found is not None:
            if row.windows is not None:
                row.stop_reading_windows()
            copied = copy_checkpoint(row, *found, self.bridge.layout)
            self.counters["prefix_tokens_copied"] += copied
        # A row not yet let in starts beside this one only if the batch holds
        # two: with one, it starts once this row left, and a stop for it is a
        # forward nobody copies from.
        waiting = [*self.prefilling, *self.incoming] if self.max_batch > 1 else []
        if row.windows is not None and any(
            would_copy(other, row, row.windows.positions, self.min_shared_tokens)
            for other in waiting
        ):
            row.stop_reading_windows()

    def _start(self, row) -> None:
        if row.started is None:
            row.started = time.perf_counter()
            self.queue_wait_s += row.started - row.submitted

    def _group(self, limit: int | None) -> list:
        """The rows still prefilling whose prompts run in one forward now,
        oldest first: each that fits ``limit`` tokens as the group would run
        (``_fits``: padding counted, or a common head once) (with
        none decoding: ``max_step_tokens``, or the oldest's whole prompt),
        once it copied what prefix it can from the rows that hold one. A row
        that a row of the group would compute a long prefix of waits for it
        (prompts.py). Empty where rows cannot share prompts; the oldest alone
        when it does not fit beside another."""
        if not self.together:
            return []
        donors = [*self.batch.rows, *self.prefilling]
        group = []
        for row in list(self.prefilling):
            if row.stops or not row.chunked:
                break  # its prefill stops at checkpoints: alone, in order
            if any(waits_for(row, other, self.min_shared_tokens) for other in group):
                continue
            try:
                copied = copy_prefix(row, donors, self.min_shared_tokens)
            except BaseException as error:  # this row's cache: only its turn fails
                self.prefilling.remove(row)
                donors.remove(row)
                row.finish(error)
                continue
            self.counters["prefix_tokens_copied"] += copied
            new = row.prompt_tokens - row.prefilled
            if not group:
                cap = limit if limit is not None else max(self.max_step_tokens, new)
            else:
                cap = limit if limit is not None else self.max_step_tokens
            if self._fits([*group, row], cap):
                group.append(row)
            elif not group:
                return [row]  # alone, in chunks
        return group

    def _fits(self, rows: list, cap: int) -> bool:
        """Whether ``rows``' prompts prefill in one forward of at most ``cap``
        tokens, as they would run (``_as_one``): as one sequence, the common
        head once over the rows' one past; side by side, padding counted, and
        rows times the longest past. Either past within ``GROUP_PAST_COLUMNS``."""
        if self._as_one(rows):
            return sequence_tokens(rows) <= cap and rows[0].prefilled <= GROUP_PAST_COLUMNS
        width = max(row.prompt_tokens - row.prefilled for row in rows)
        longest = max(row.prefilled for row in rows)
        return len(rows) * width <= cap and len(rows) * longest <= GROUP_PAST_COLUMNS

    def _as_one(self, rows: list) -> bool:
        """Whether ``rows`` prefill as one sequence: where they share a head.
        Without one, it would save only the padding, and every tail would
        attend across all rows' pasts: four second turns of SmolLM2 (pasts of
        80 to 150 tokens, tails of 21 to 26) took as long either way in a
        probe (RESULTS §30)."""
        return self.as_one and shared_head(rows) > 0

    def _prefill_group(self, rows: list) -> int:
        """One forward over the rest of every row's prompt (one_sequence.py
        where they share a head, else prompts.py); every row then picks its
        first token, and only then does each join the batch. Returns the
        tokens the forward ran (padding counted; a common head once)."""
        for row in rows:
            self.prefilling.remove(row)
            self._start(row)
        one = self._as_one(rows)
        if one:
            tokens = sequence_tokens(rows)
            head_saved = (len(rows) - 1) * shared_head(rows)
        else:
            tokens = len(rows) * max(row.prompt_tokens - row.prefilled for row in rows)
        try:
            logits = self._forward_together(rows)
        except BaseException as error:  # the forward failed: every row in it fails
            for row in rows:
                row.finish(error)
            return tokens
        self.counters["prefill_chunks"] += 1
        self.counters["prompts_prefilled_together"] += len(rows)
        if one:
            self.counters["head_tokens_run_once"] += head_saved
        # Every row's first token goes out before any row joins the batch: a
        # join copies the row's cache, and the last row's token would wait
        # for all the others' copies.
        picked = []
        for row, row_logits in zip(rows, logits, strict=True):
            try:
                picked.append((row, row.pick(row_logits)))
            except BaseException as error:  # the row's processor or streamer
                row.finish(error)
        for row, done in picked:
            try:
                if done:
                    self._finish(row)
                else:
                    self.batch.join(row)
            except BaseException as error:  # the row's cache
                if row.slot is not None:
                    self.batch.leave(row, write_back=False)
                row.finish(error)
        return tokens

    def _forward_together(self, rows: list) -> list:
        """``prefill_as_one`` (or ``prefill_together``) on ``rows``. A forward that declares
        ``logits_to_keep`` a tensor yet slices by a count (older remote code)
        raises on positions (a TypeError or IndexError) or gives other logits
        than asked: the forward then runs again asking for every position's
        logits (no row's cache has changed), and does from then on where that
        works. Any other failure (out of memory) fails the rows at once."""
        forward = prefill_as_one if self._as_one(rows) else prefill_together
        args = (self.model, rows, self.bridge.new_cache, self.bridge.cache_argument)
        if self.keep_kind != "tensor":
            return forward(*args, self.keep_kind)
        try:
            return forward(*args, "tensor")
        except (TypeError, IndexError, LogitsShapeError) as error:
            first = error
        logits = forward(*args, "int")
        self.keep_kind = "int"
        logger.warning(
            "kvchat: the model's forward failed on logits_to_keep as positions (%s); "
            "prompts prefilled together now take every position's logits",
            first,
        )
        return logits


class _WarmRow:
    """What a row of a warm-up batch needs to join it."""

    def __init__(self, cache, ids):
        self.cache, self.ids, self.length = cache, ids, ids.shape[1]
        self.slot, self.joined_length = None, 0


_LIVE: weakref.WeakSet = weakref.WeakSet()


_EXITING = threading.Event()  # set at interpreter exit: no engine thread starts again


@atexit.register
def _close_all() -> None:  # a thread inside the model at interpreter exit aborts it
    _EXITING.set()
    for loop in list(_LIVE):
        loop.close()
        loop.release_weights()  # oneDNN's copies freed while the interpreter still runs


class Engine:
    """Runs every forward of one manager's model on one thread (module docstring)."""

    def __init__(
        self,
        model,
        bridge,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        on_batch_bytes: Callable[[int], None] | None = None,
        min_shared_tokens: int = SHARE_MIN_TOKENS,
        pack_weights: bool | str = "auto",
        compiled=None,
    ):
        """``on_batch_bytes(n)``: told the decode batch's buffer bytes each
        time they change (the manager counts them in ``max_cache_bytes``);
        ``min_shared_tokens``: the shortest prefix a row copies from another
        of its share scope (prompts.py); ``pack_weights``: packed.py, not
        for a model the manager compiles; ``compiled``: the manager's
        ``CompiledDecode`` (compiled.py), whose config compiles the batch's
        steps while it is enabled."""
        if getattr(getattr(model, "device", None), "type", None) == "cuda":
            graph_trees.import_here()  # on this thread, not the engine's (graph_trees.py)
        self._loop = _Loop(model, bridge, max_batch, max_step_tokens, min_shared_tokens)
        requested = compiled is not None and compiled.requested
        self._packed = packed.PackedWeights(model, pack_weights, requested)
        if compiled is not None and compiled.enabled:
            self._loop.batch.compiled = compiled
        self._loop.packs = self._packed.packs
        self._loop.release_weights = self._packed.release
        self._loop.check_weights = self._packed.verify
        self._loop.batch.on_bytes = on_batch_bytes
        rope = length_dependent_rope(getattr(model, "config", None))
        # Why no turn of this model decodes in the batch (None: they do).
        self._model_problem = (
            None
            if rope is None
            else f"rope_type {rope!r}: its frequencies follow the longest position in a forward"
        )
        _LIVE.add(self._loop)

    def __del__(self):
        weights = getattr(self, "_packed", None)
        if weights is not None:
            weights.release()
        loop = getattr(self, "_loop", None)
        if loop is not None:
            with loop.cond:
                loop.closed = True
                loop.cond.notify_all()

    @property
    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._loop.thread

    def cannot_batch(self, cache) -> str | None:
        return self._model_problem or unsupported_layer(cache)

    @property
    def model_problem(self) -> str | None:
        """Why no turn of this model decodes in the batch (None: they do)."""
        return self._model_problem

    def warm_up_batch(self, compiled, columns: int, tokens: int, steps: int) -> list[int]:
        """Runs the batch step (``compiled``'s) for one row and for two (or
        one alone, for a batch of at most one) in ``columns`` columns, on
        the engine's thread, compiling what has not compiled yet; the row
        counts warmed. One row is a graph of its own (dynamo specializes
        sizes of 1); from two on, the rows are a dynamic size (the batch
        marks them, and the columns: ``DecodeBatch._mark_static``), so 4, 8
        or 16 rows, or other columns, compile nothing, and warming more rows
        would only allocate their buffers (16 rows in 4096 columns of
        SmolLM2 in float32: 3 GB)."""
        counts = [1, 2] if self._loop.max_batch > 1 else [1]
        for rows in counts:
            self.run(lambda rows=rows: self._loop.warm_up(compiled, columns, rows, tokens, steps))
        return counts

    @contextlib.contextmanager
    def expect(self, share_scope: str | None = None):
        """Around a turn, from its start to its end: until the turn submits
        its row (or work that runs alone), the engine knows one more prompt
        is on its way and lets the waiting ones gather for it (GATHER_S).
        ``share_scope``: the rows whose prefixes the turn's row may copy
        (prompts.share_scope; None: none)."""
        loop, local = self._loop, self._loop.announced
        depth = getattr(local, "depth", 0)
        if depth == 0:  # counted once, should a turn ever begin inside one
            with loop.cond:
                loop.expected += 1
            local.pending = True
            local.scope = share_scope
        local.depth = depth + 1
        try:
            yield
        finally:
            local.depth = depth
            if depth == 0:
                self._arrived()
                local.scope = None

    def _arrived(self) -> None:
        """This thread's expected turn reached the engine (or ended)."""
        loop = self._loop
        if getattr(loop.announced, "pending", False):
            loop.announced.pending = False
            with loop.cond:
                loop.expected -= 1
                loop.cond.notify_all()  # a prompt gathering for it stops waiting

    def decode(self, row) -> torch.Tensor:
        """Prefills and decodes ``row`` beside the others; its ids once finished."""
        if self.on_engine_thread:  # it would wait for itself
            raise RuntimeError("a turn cannot be decoded from the engine's own thread")
        row.share_scope = getattr(self._loop.announced, "scope", None)
        self._arrived()  # first: the engine must never wait for this very row
        self._loop.submit(self._loop.incoming, row)
        return row.wait()

    def run(self, fn: Callable[[], object], why: str = ""):
        """``fn()`` on the engine's thread, alone, between steps (under the
        caller's autocast); inline when called there already."""
        if self.on_engine_thread:
            return fn()
        if why:
            logger.debug("kvchat: a turn runs alone on the engine (%s)", why)
        job = _Job(with_callers_autocast(fn))
        self._arrived()
        self._loop.submit(self._loop.jobs, job)
        return job.wait()

    def when_idle(self, fn: Callable[[], object]):
        """``fn()`` on the engine's thread once no row decodes or prefills."""
        if self.on_engine_thread:
            return fn()
        job = _Job(fn)
        self._loop.submit(self._loop.idle, job)
        return job.wait()

    @contextlib.contextmanager
    def hold(self):
        """While entered, submitted turns wait and no new row starts; on
        leaving, every waiting turn starts together (up to the batch's
        maximum). Rows already decoding go on."""
        loop = self._loop
        with loop.cond:
            loop.held += 1
        try:
            yield
        finally:
            with loop.cond:
                loop.held -= 1
                loop.cond.notify_all()

    def close(self) -> None:
        # The loop stays in _LIVE: a turn after close() starts its thread
        # again, which the exit must close too (daemon_threads.py waits for it).
        self._loop.close()
        self._packed.release()  # after the thread ended: no forward is using them
        self._loop.packs = False  # a turn after close() restarts the thread, unpacked

    def counters(self) -> dict:
        loop = self._loop
        with loop.cond:
            steps = loop.counters["decode_steps"]
            return {
                "decode_steps": steps,
                "mean_batch_rows": loop.counters["decode_rows"] / steps if steps else 0.0,
                "max_batch_rows": loop.max_rows,
                "batch_rows": len(loop.batch.rows),
                "prefilling": len(loop.prefilling),
                "queued": len(loop.incoming),
                "queue_wait_ms": loop.queue_wait_s * 1e3,
                "prefill_chunks": loop.counters["prefill_chunks"],
                "prompts_prefilled_together": loop.counters["prompts_prefilled_together"],
                "prefix_tokens_copied": loop.counters["prefix_tokens_copied"],
                "head_tokens_run_once": loop.counters["head_tokens_run_once"],
                "gather_waits": loop.counters["gather_waits"],
                "jobs_run_alone": loop.counters["jobs_run_alone"],
                "idle_jobs": loop.counters["idle_jobs"],
                "batch_bytes": loop.batch.bytes_now,
                "packed_weight_bytes": self._packed.nbytes,
            }
