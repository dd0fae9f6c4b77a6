"""Settling between turns: the session is brought to the ids its next prompt
will start with, while the user reads and types or the agent runs its tool.

After a reply, kvchat knows how the client will send the conversation back:
the history, then the reply as an assistant message, rendered by the chat
template. Those ids often depart from what the session cached: a reply that
re-tokenizes differently, a tool call re-rendered from JSON, a reasoning
block the template drops, a generation prompt whose last token merges with
the reply's first. A layer that cannot crop (recurrent, conv, sliding) then
falls back to a checkpoint before the departure, and the next turn prefills
the difference on its critical path. Settling prefills it in the free time
instead, so the next turn prefills only its new messages.

``Settler`` runs settles from one background thread, its forwards handed to
the engine as idle work (``engine/``), only while no turn runs
(turns of every session count: settling never slows one down by more than
the chunk it is in), in chunks of a few tens of milliseconds. A turn on the
session being settled takes over: the settle stops at its chunk's end and
hands what it prefilled to the turn, which commits it when its prompt starts
with those ids. Until a settle commits, the session keeps the cache it had,
so a prediction that missed loses nothing; the commit is refused if anything
changed the cache meanwhile (the core's cache version).

A settle starts only once no turn has run for ``delay`` seconds
(``SessionManager(settle_delay=)``): its own session's, or any other's. A
client that sends its next turn at once (an agent whose tool answered in
milliseconds, a script) then drops the settle and its turn prefills those
ids in its own forward, instead of waiting for the settle's forward to end
first: on a CPU a forward over a few tokens costs nearly what one over
twenty does (RESULTS §29). A user who reads the reply leaves the settle
time enough to run. ``wait`` starts every waiting settle at once.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _C, daemon_threads  # first: its hook, which waits for our threads, runs after ours

logger = logging.getLogger("kvchat")

# A chunk of the settling prefill aims at this long, or at twice a forward's
# fixed cost where that is more (a large model on a CPU reads every weight
# again per forward, so 8-token chunks cost several times their tokens): a
# turn that starts meanwhile waits at most about one chunk for the model.
_CHUNK_SECONDS = 0.02
_MIN_CHUNK, _MAX_CHUNK = 8, 512
# How long no turn must have run before a settle starts (module docstring):
# longer than an agent's round trip with a quick tool, shorter than reading.
SETTLE_DELAY_S = 0.25


@dataclass
class _Job:
    session_id: str
    # 1-D int64 ids, or a function that renders them (on the settle thread,
    # off the turn's path; None: nothing to predict)
    target: torch.Tensor | Callable[[], torch.Tensor | None]
    version: int  # the session's cache version it was predicted from
    stop: bool = False  # a turn on the session takes over
    in_lease: bool = False  # planning or committing: users of the session wait
    handover: tuple | None = None  # (plan, cache, settled tokens, checkpoints) for the turn
    scheduled: float = 0.0  # time.monotonic()


# Settlers with a live thread: stopped at exit, since a thread still inside
# the model when the interpreter finalizes aborts the process.
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for settler in list(_LIVE):
        settler.close()


class Settler:
    """Settles sessions on one background thread (see the module docstring).

    ``hold`` wraps every call that leases a session: a turn takes over that
    session's settle and counts toward "a turn is running", any other call
    only waits out the settle's short leased sections."""

    def __init__(
        self,
        core,
        bridge,
        prefill,
        device,
        engine,
        flush_evicted=lambda: None,
        delay: float = SETTLE_DELAY_S,
    ):
        """``flush_evicted``: called after each lease the settle thread takes,
        whose release may have evicted sessions (to hand them to the tier).
        ``delay``: seconds without a turn before a settle starts."""
        self._delay = delay
        self._quiet_from = 0.0  # time.monotonic() when the last turn ended
        self._waiters = 0  # callers in wait(): every waiting settle is due now
        self._core, self._bridge, self._prefill, self._device = core, bridge, prefill, device
        self._engine = engine  # runs the forwards, when no turn's row decodes or prefills
        self._flush_evicted = flush_evicted
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}  # waiting, oldest first
        self._running: _Job | None = None
        self._users: Counter[str] = Counter()  # sessions leased by calls, not by settles
        self._turns = 0  # turns running (any session)
        # The last prediction per session, as (length, hash): a turn that does
        # not start with it is a miss.
        self._predicted: dict[str, tuple[int, bytes]] = {}
        self._thread: threading.Thread | None = None
        self._retired: threading.Thread | None = None  # the last thread that ended
        self._closed = False
        self._chunk = _MIN_CHUNK  # sized by _adapt once measured
        self._quickest = float("inf")  # the quickest settle forward seen, in seconds
        # Counted here, the rest (settles, settled tokens) by the core.
        self._misses = 0  # turns whose prompt did not start with the prediction
        self._taken_over = 0  # settles a turn on the session took over and committed
        self._settle_ms = 0.0  # time spent prefilling in settles
        # The last settle commit of each session: (version before, after).
        self._committed: dict[str, tuple[int, int]] = {}

    # ---------------------------------------------------------- scheduling
    def schedule(self, session_id: str, target, version: int) -> None:
        """Settles ``session_id`` to ``target`` (ids, or a function that
        renders them) once no turn has run for ``delay`` (counted from now at
        the earliest), if its cache is still ``version`` then. Replaces any
        settle waiting for it."""
        with self._cond:
            if self._closed:
                return
            self._predicted.pop(session_id, None)
            if isinstance(target, torch.Tensor):
                self._predicted[session_id] = _digest(target)
            if self._running is not None and self._running.session_id == session_id:
                self._running.stop = True  # outdated: its handover is dropped
            self._jobs.pop(session_id, None)
            before, after = self._committed.get(session_id, (None, None))
            if version == before:  # read just before a settle of it committed
                version = after
            self._jobs[session_id] = _Job(session_id, target, version, scheduled=time.monotonic())
            if self._thread is None:  # it ends when nothing is left to do
                self._thread = daemon_threads.start(self._work, "kvchat-settle")
                _LIVE.add(self)
            self._cond.notify_all()

    def forget(self, session_id: str) -> None:
        with self._cond:
            self._jobs.pop(session_id, None)
            self._predicted.pop(session_id, None)
            self._committed.pop(session_id, None)
            if self._running is not None and self._running.session_id == session_id:
                self._running.stop = True

    def wait(self, timeout: float | None = None) -> bool:
        """Starts every waiting settle at once (no ``delay``) and waits until
        none is waiting or running; False if ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._waiters += 1  # no settle waits out its delay meanwhile
            self._cond.notify_all()
            try:
                while self._jobs or self._running is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    _wait(self._cond, left)
            finally:
                self._waiters -= 1
        return True

    def close(self) -> None:
        """Drops waiting settles, stops a running one at its chunk's end and
        waits for the thread to end."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            if self._running is not None:
                self._running.stop = True
            self._cond.notify_all()
            threads = (self._thread, self._retired)
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        _LIVE.discard(self)

    def counters(self) -> dict:
        with self._cond:
            return {
                "settle_misses": self._misses,
                "settles_taken_over": self._taken_over,
                "settle_ms": self._settle_ms,
                "settles_pending": len(self._jobs) + (self._running is not None),
            }

    # --------------------------------------------------------- the callers
    @contextlib.contextmanager
    def hold(self, session_id: str, prompt: torch.Tensor | None = None):
        """While a call leases ``session_id``: the settle thread takes no lease
        on it meanwhile. With ``prompt`` it is a turn: it counts as running
        (settling pauses), a waiting settle of this session is dropped and a
        running one stops at its chunk's end. Yields a list holding what that
        settle prefilled (for ``take_over``, which empties it), or an empty one."""
        turn = prompt is not None
        box = []
        with self._cond:
            self._users[session_id] += 1
            if turn:
                self._turns += 1
        try:
            with self._cond:
                if turn:
                    self._jobs.pop(session_id, None)
                    predicted = self._predicted.pop(session_id, None)
                    if predicted is not None and not _matches(prompt, predicted):
                        self._misses += 1
                job = self._running
                if job is not None and job.session_id == session_id:
                    if turn:
                        job.stop = True
                        self._cond.notify_all()
                    # A leased section is short; a turn also waits out the chunk in progress.
                    while self._running is job and (job.in_lease or turn):
                        self._cond.wait()
                    if turn and job.handover is not None:
                        box.append(job.handover)
                        job.handover = None  # the turn's alone: it dies with the turn's use
            del job
            yield box
        finally:
            with self._cond:
                self._users[session_id] -= 1
                if not self._users[session_id]:
                    del self._users[session_id]
                if turn:
                    self._turns -= 1
                    if not self._turns:
                        self._quiet_from = time.monotonic()
                self._cond.notify_all()

    def take_over(self, lease, prompt: torch.Tensor, box: list) -> None:
        """Under the turn's lease: commits what an interrupted settle prefilled
        (``box``, from ``hold``, emptied here) when the turn's prompt starts
        with those ids; else it is dropped and the session keeps the cache it had."""
        if not box:
            return
        plan, cache, settled, checkpoints = box.pop()
        if settled <= plan.kept_tokens or not _starts_with(prompt, plan.target[:settled]):
            return
        try:
            layers = self._bridge.from_cache(cache, settled)
            result = _C.SettleResult(settled_tokens=settled, layers=layers, checkpoints=checkpoints)
            taken = self._core.finish_settle(lease, plan, result)
        except Exception:  # settling is an optimization: the turn goes on without it
            logger.exception("kvchat: taking over %r's settle failed", lease.session.id)
            return
        if taken:
            with self._cond:
                self._taken_over += 1

    # --------------------------------------------------------- the worker
    def _work(self) -> None:
        while True:
            with self._cond:
                job = None
                while not self._closed and self._jobs:
                    until = None  # the wait: for a change, or the next settle's delay
                    if self._turns == 0:
                        now = time.monotonic()
                        free = [j for j in self._jobs.values() if j.session_id not in self._users]
                        due = [(self._due(j), j) for j in free]
                        job = next((j for at, j in due if self._waiters or at <= now), None)
                        if job is None and free:
                            until = min(at for at, _ in due) - now
                    if job is not None:
                        break
                    _wait(self._cond, until)
                if job is None:  # closed, or nothing left: a new job starts a new thread
                    self._thread = None
                    self._retired = threading.current_thread()  # close() joins it still
                    self._cond.notify_all()
                    return
                del self._jobs[job.session_id]
                self._running = job
            try:
                self._settle(job)
            except Exception:  # settling is an optimization: never fatal
                logger.exception(
                    "kvchat: settling %r failed; its next turn matches as usual", job.session_id
                )
            finally:
                with self._cond:
                    self._running = None
                    job.in_lease = False
                    self._cond.notify_all()

    def _due(self, job: _Job) -> float:
        """When ``job`` may start: ``delay`` after it was scheduled and after
        the last turn ended."""
        return max(job.scheduled, self._quiet_from) + self._delay

    def _leased(self, job: _Job, work):
        """Runs ``work(lease)`` with the job's session leased (marked
        ``in_lease`` by the caller, under the lock); None when the session is
        gone or in use."""
        try:
            try:
                lease = self._core.acquire(job.session_id, wait=False, create=False, touch=False)
            except (KeyError, _C.SessionBusy):
                return None
            with lease:
                return work(lease)
        finally:
            with self._cond:
                job.in_lease = False
                self._cond.notify_all()
            self._flush_evicted()

    def _settle(self, job: _Job) -> None:
        if not isinstance(job.target, torch.Tensor):
            job.target = job.target()
            if job.target is None:
                return
            with self._cond:
                if job.stop:
                    return
                self._predicted[job.session_id] = _digest(job.target)
        # The delay again: a turn may have run since this settle started (while
        # its target rendered), and most settles are one chunk, with no pause.
        if not self._pause(job):
            return

        def begin(lease):
            if lease.session.version != job.version:
                return None
            return self._core.begin_settle(lease, job.target)

        with self._cond:
            # A call that holds the session (a save, say) goes first.
            while job.session_id in self._users and not (job.stop or self._closed):
                self._cond.wait()
            if job.stop or self._closed:
                return
            job.in_lease = True
        plan = self._leased(job, begin)
        if plan is None or not plan.needed:
            return
        started = time.perf_counter()
        cache = self._bridge.to_cache(plan.take_layers(), reserve=plan.target_tokens)
        ids = plan.target.unsqueeze(0).to(self._device)
        positions = set(plan.checkpoint_positions)
        checkpoints, done, end = [], plan.kept_tokens, plan.target_tokens
        while done < end and not job.stop:
            stop = min([end, done + self._chunk, *(p for p in positions if p > done)])
            self._adapt(
                stop - done,
                self._engine.when_idle(_timed_forward(self._prefill, ids, cache, done, stop)),
            )
            done = stop
            if done in positions:
                checkpoints.append(_C.Checkpoint(done, self._bridge.snapshot(cache, done)))
            if done < end and not self._pause(job):
                break
        with self._cond:
            self._settle_ms += (time.perf_counter() - started) * 1e3
            # A call that holds the session (a save, say) goes first.
            while job.session_id in self._users and not (job.stop or self._closed):
                self._cond.wait()
            if job.stop or self._closed:  # a turn on this session waits for what was done
                job.handover = (plan, cache, done, checkpoints)
                return
            job.in_lease = True  # from here the turn waits for the commit

        def commit(lease):
            before = lease.session.version
            layers = self._bridge.from_cache(cache, done)
            result = _C.SettleResult(settled_tokens=done, layers=layers, checkpoints=checkpoints)
            finished = self._core.finish_settle(lease, plan, result)
            self._carry_version(job.session_id, before, lease.session.version)
            return finished

        self._leased(job, commit)

    def _carry_version(self, session_id: str, before: int, after: int) -> None:
        """A settle's commit is not a turn: a newer settle of the session,
        scheduled while this one ran (an app's ``settle`` on the tool calls
        it parsed, right after the turn's own), was predicted from the cache
        this commit started from, and stays due. Without this, that newer
        settle found the version moved and was dropped."""
        with self._cond:
            self._committed[session_id] = (before, after)
            waiting = self._jobs.get(session_id)
            if waiting is not None and waiting.version == before:
                waiting.version = after

    def _pause(self, job: _Job) -> bool:
        """Before each chunk: waits while any turn runs, and ``delay`` after
        the last one ended. False when a turn on this session (or a newer
        prediction) stops the settle."""
        with self._cond:
            while not (job.stop or self._closed):
                if self._turns > 0:
                    self._cond.wait()
                    continue
                left = self._quiet_from + self._delay - time.monotonic()
                if self._waiters or left <= 0:
                    break
                _wait(self._cond, left)  # a turn that just ended may have a next one coming
            return not (job.stop or self._closed)

    def _adapt(self, tokens: int, seconds: float) -> None:
        """Sizes the next chunk: about _CHUNK_SECONDS, or twice the quickest
        forward seen (about a forward's fixed cost) where that is longer, so
        at most half of a chunk's time goes to its fixed cost."""
        if tokens > 0 and seconds > 0:
            self._quickest = min(self._quickest, seconds)
            target = max(_CHUNK_SECONDS, 2 * self._quickest)
            rate = tokens / seconds
            self._chunk = int(min(_MAX_CHUNK, max(_MIN_CHUNK, rate * target)))


def _wait(cond: threading.Condition, seconds: float | None) -> None:
    """``cond.wait(seconds)``, capped at what a lock can wait (about 292
    years): a longer wait (settle_delay=1e10) raised OverflowError, and the
    settle thread died of it. The callers check again when it returns."""
    cond.wait(None if seconds is None else min(seconds, threading.TIMEOUT_MAX))


def _digest(ids: torch.Tensor) -> tuple[int, bytes]:
    """(length, hash) of a prediction: all a later turn needs to tell a miss."""
    return ids.numel(), hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).digest()


def _matches(prompt: torch.Tensor, predicted: tuple[int, bytes]) -> bool:
    n = predicted[0]
    return prompt.numel() >= n and _digest(prompt[:n].contiguous()) == predicted


def _starts_with(ids: torch.Tensor, prefix: torch.Tensor) -> bool:
    n = prefix.numel()
    return ids.numel() >= n and _C.common_prefix_length(ids[:n], prefix) == n


def _timed_forward(prefill, ids, cache, begin: int, end: int):
    """A settle chunk's forward, to run on the engine's thread; returns its seconds."""

    def forward() -> float:
        began = time.perf_counter()
        prefill.forward(ids, cache, begin, end)
        if ids.device.type == "cuda":  # time the work, not its launch
            torch.cuda.synchronize(ids.device)
        return time.perf_counter() - began

    return forward
