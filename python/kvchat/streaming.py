"""A streamed turn: text pieces as they are generated, and a way to stop.

A worker thread runs the turn (lease, plan, ``generate``, commit); the
engine decodes it (``engine/``) and feeds a ``TextQueue``, which queues each
token's text as soon as it is final (``detokenize.IncrementalText``). A
consumer that stops reading (``close()``, ``break`` out of a ``for`` loop, or
dropping the stream, as a server does when its client disconnects) sets a flag
that a stopping criterion reads after every token, so the turn stops within
a token and commits what it generated: the session stays exact and is free for
its next turn at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from . import daemon_threads
from .detokenize import IncrementalText
from .engine.threads import with_callers_autocast

if TYPE_CHECKING:
    from .report import TurnReport

_END = object()  # queued once, after the last piece


class StopWhenSet(StoppingCriteria):
    """Stops every sequence once ``event`` is set."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        stop = self.event.is_set()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class TextQueue(BaseStreamer):
    """A generate streamer: queues the reply's text, token by token, as soon as
    each piece is final, then ``_END``. The prompt (generate's first ``put``)
    is not part of the reply."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, end_ids=()):
        self._text = IncrementalText(tokenizer, skip_special_tokens, end_ids)
        self._prompt_seen = False
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError("a reply stream holds one sequence, not a batch")
        for token in value.reshape(-1).tolist():
            piece = self._text.push(token)
            if piece:
                self.queue.put(piece)

    def end(self) -> None:
        rest = self._text.finish()
        if rest:
            self.queue.put(rest)
        self.queue.put(_END)


class ReplyStream(Iterator[str]):
    """Iterates over the reply's text pieces; ``close()`` stops generation."""

    def __init__(
        self, tokenizer, generate_kwargs: dict, skip_special_tokens: bool = True, end_ids=()
    ):
        """``generate_kwargs`` plus this stream's streamer and stopping criterion
        become ``self.kwargs``, what the turn passes to generate. Pieces keep
        special tokens with ``skip_special_tokens=False``, except ``end_ids``."""
        self._cancel = threading.Event()
        self._streamer = TextQueue(tokenizer, skip_special_tokens, end_ids)
        self._ended = False  # the last piece was returned: next() stops at once
        criteria = StoppingCriteriaList(
            [*(generate_kwargs.get("stopping_criteria") or []), StopWhenSet(self._cancel)]
        )
        self.kwargs = dict(generate_kwargs, streamer=self._streamer, stopping_criteria=criteria)
        self._failure: list[BaseException] = []
        self._result: list = []
        self._worker: threading.Thread | None = None
        self._ender: Callable | None = None  # the manager's end of the turn (end())

    def start(
        self, run: Callable[[], object], name: str, ender: Callable | None = None
    ) -> ReplyStream:
        """Runs the turn ``run`` (which passes ``self.kwargs`` to generate) in a
        worker; what it returns becomes ``self.report``. ``ender(self, ...)``
        is what ``end(...)`` runs."""
        self._ender = ender
        # The worker holds no reference to this object, so dropping it unread
        # reaches __del__ while generation is still running.
        self._worker = daemon_threads.start(
            _work, name, (with_callers_autocast(run), self._streamer, self._failure, self._result)
        )
        return self

    def __next__(self) -> str:
        if not self._ended:
            piece = self._streamer.queue.get()
            if piece is not _END:
                return piece
            self._ended = True
        self._worker.join()
        if self._failure:
            failure, self._failure = self._failure[0], []
            raise failure
        raise StopIteration

    @property
    def report(self):
        """What the turn reported (a ``TurnReport``), once the stream is exhausted
        or closed; None before that, or when the turn failed."""
        return self._result[0] if self._result else None

    def cancel(self) -> None:
        """Stops generation within a token, without waiting (``close`` waits)."""
        self._cancel.set()

    def close(self) -> None:
        """Stops generation within a token and waits until the turn is committed."""
        self._cancel.set()
        worker = self._worker
        if worker is not None and worker.is_alive() and threading.current_thread() is not worker:
            worker.join()

    def end(
        self,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        flush_timeout: float | None = 0.0,
    ) -> TurnReport | None:
        """Ends the turn in one call and returns its ``TurnReport`` (None if
        the turn failed: ``next()`` raises its error).

        In order: stops generation within a token if it still runs and waits
        until the turn is committed (``close()``); with ``flush_timeout``
        (seconds; None: no limit; 0, the default: no wait), waits that long at
        most for a shared store to write the session's snapshot, so a next
        turn on another process finds it (``flush``); then, given
        ``messages``, what the caller will send back (the history and the
        reply as the caller returns it: cut at a stop string, with parsed
        ``tool_calls``), settles the session for a next turn that starts with
        them, as ``settle()`` does, rendered with ``tools`` and
        ``chat_template_kwargs`` (None: this turn's own). Pass
        ``settle=False`` to ``stream_chat`` then, so the raw reply is never
        settled on. A failed turn is not settled, nor a session removed
        meanwhile.

        A ``flush_timeout`` that is not a number of seconds >= 0 or None
        raises before anything is done. ``messages`` that ``settle()`` refuses
        raise as there, once the turn is committed and flushed: nothing is
        settled."""
        if self._ender is None:  # a stream no manager started: nothing to settle or flush
            self.close()
            return self.report
        return self._ender(self, messages, tools, chat_template_kwargs, flush_timeout)

    def __del__(self):
        # Dropped unread (a for loop left with break): stop, without waiting here.
        self._cancel.set()


def _work(run, streamer, failure: list, result: list) -> None:
    try:
        result.append(run())
    except BaseException as error:  # re-raised in the consumer's thread
        failure.append(error)
        streamer.end()
