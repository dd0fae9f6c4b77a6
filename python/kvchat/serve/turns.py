"""Running a request's turn: a slot among ``--max-pending``, the session the
router gives it, the grammar it is constrained with, the stream the model
writes, and, however the request ends, one call that ends it (``finish``: the
library's ``ReplyStream.end``, then the slot, the router and the expiry). The
endpoints (chat completions, responses) only shape what goes over the wire."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading

from starlette.concurrency import run_in_threadpool

from ..agents import detect
from ..agents.grammar import GrammarError, Grammars
from ..arguments import ContextLengthError
from ..prompting import end_ids
from .chat_request import ChatRequest
from .chat_template import merged
from .errors import APIError
from .reply import DONE, Reply, calls_allowed, tool_format

logger = logging.getLogger("kvchat.serve")


class ServerTurns:
    """``kvchat serve``'s turns. ``begin`` starts one and returns its ``Reply``;
    ``finish`` (once its text is read) or ``abandon`` (its client left) ends it;
    ``sent`` (its response ended) frees its session for the idle expiry."""

    def __init__(self, manager, config, router, metrics, expiry):
        self.manager, self.config, self.router = manager, config, router
        self.metrics, self.expiry = metrics, expiry
        self.pending = threading.BoundedSemaphore(config.max_pending)
        self.stop_ids = end_ids(manager.tokenizer, manager.model.generation_config)
        self.calls_format = detect(manager.tokenizer)  # the template's tool-call markup, if known
        self.grammars = Grammars(manager.tokenizer, _vocab_size(manager.model), self.stop_ids)

    async def begin(self, ns: str, chat: ChatRequest, explicit: str | None) -> Reply:
        """Claims the session (``explicit``, or found by the conversation) and
        starts the turn; what is refused before generation is an APIError."""
        if chat.prompt is None and self.config.chat_template_kwargs:  # --chat-template-kwargs
            own = merged(self.config.chat_template_kwargs, chat.template_kwargs)
            chat = dataclasses.replace(chat, template_kwargs=own)
        fmt = tool_format(chat, self.calls_format)
        if not self.pending.acquire(blocking=False):
            self.metrics.requests.labels("429").inc()
            raise APIError(
                429,
                f"more than {self.config.max_pending} requests are in progress; retry later",
                code="rate_limit_exceeded",
            )
        # Compiled in the slot (a grammar's CPU counts among --max-pending), and
        # before any session is claimed: a bad schema is a 400 that touches nothing.
        processor = await self._compile(chat, fmt) if chat.constrained else None
        try:
            session = await self._claim(ns, explicit, chat)
        except BaseException:
            self.pending.release()
            raise
        self.expiry.begin(session)  # until finish() and sent(): never expires while in use
        max_tokens = chat.max_tokens or self.config.default_max_tokens
        try:
            stream, first = await self._start(session, chat, max_tokens, fmt, processor)
        except BaseException as error:
            self.pending.release()
            self.expiry.end(session)
            released = self._release_failed(ns, session)
            if not isinstance(error, asyncio.CancelledError):
                await released  # before the error reaches the client, who may retry at once
            raise
        turn = Reply(stream, first, chat, max_tokens, session, ns, fmt)
        turn.grammar = processor
        return turn

    def session_header(self, turn: Reply) -> dict:
        return {"X-Session-ID": self.router.external(turn.ns, turn.session) or turn.session}

    async def _claim(self, ns: str, explicit: str | None, chat: ChatRequest) -> str:
        """self.router.claim, off the event loop when it asks the shared store (a
        network call). If the request is cancelled meanwhile (its client
        left), the claim is released as a failed turn once it is made: never
        a session held out of the map for ever."""
        if chat.prompt is not None:  # a text completion: routed here, by its text
            return self.router.claim_text(ns, explicit, chat.prompt)
        if not self.router.shared:
            return self.router.claim(ns, explicit, chat.messages)
        loop = asyncio.get_running_loop()
        claimed = loop.run_in_executor(None, self.router.claim, ns, explicit, chat.messages)
        try:
            return await asyncio.shield(claimed)
        except asyncio.CancelledError:

            def release(done) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._release_failed(ns, done.result())

            claimed.add_done_callback(release)
            raise

    def _release_failed(self, ns: str, session: str) -> asyncio.Future:
        """self.router.release for a turn that never ran, off the event loop when it
        writes to the shared store (a network call that a hung store stalls)."""
        loop = asyncio.get_running_loop()
        if not self.router.shared:
            self.router.release(ns, session, None)
            done = loop.create_future()
            done.set_result(None)
            return done
        return asyncio.shield(loop.run_in_executor(None, self.router.release, ns, session, None))

    async def _compile(self, chat: ChatRequest, fmt):
        """self._constrain on a thread, in the slot begin() took, which is
        freed if it fails. If the request is cancelled meanwhile (its client
        left), the slot is freed once the compile ends: clients that leave
        never run more compiles at once than --max-pending."""
        compiling = asyncio.get_running_loop().run_in_executor(None, self._constrain, chat, fmt)
        try:
            return await asyncio.shield(compiling)
        except asyncio.CancelledError:

            def free(done) -> None:
                if not done.cancelled():
                    done.exception()  # read: an error no one awaits is not logged as lost
                self.pending.release()

            compiling.add_done_callback(free)
            raise
        except BaseException:
            self.pending.release()
            raise

    def _constrain(self, chat: ChatRequest, fmt):
        """The grammar's logits processor for a constrained request; 400 for a
        schema llguidance refuses or a tool-call markup it cannot write."""
        try:
            if chat.tool_choice == "required":
                if fmt is None:
                    raise GrammarError(
                        "tool_choice",
                        "tool_choice 'required' needs a tool-call format kvchat recognizes "
                        "in the chat template (docs/agents.md); this one has none",
                    )
                tools = [t for t in chat.tools if chat.tool_name in (None, t["function"]["name"])]
                grammar = self.grammars.tool_calls(fmt, tools, chat.parallel_tool_calls)
                return self.grammars.processor(grammar, "tool_choice")
            if fmt is not None and fmt.grammar is not None and calls_allowed(chat):
                # Tools offered (auto) beside a JSON response_format: a call or the JSON.
                grammar = self.grammars.tool_calls(
                    fmt, chat.tools, chat.parallel_tool_calls, or_json=chat.json_schema
                )
                return self.grammars.processor(grammar, "response_format")
            grammar = self.grammars.json_schema(chat.json_schema)
            return self.grammars.processor(grammar, "response_format")
        except GrammarError as error:
            raise APIError(400, str(error), param=error.param, code="invalid_value") from None

    async def _start(self, session: str, chat: ChatRequest, max_tokens: int, fmt, processor):
        """Starts the turn and waits for its first piece, so what is refused
        before generation (a context overflow, say) is an error status."""
        kwargs = dict(chat.generate_kwargs)
        if chat.seed is not None:  # the turn's own generator: the same tokens alone or batched
            kwargs["seed"] = chat.seed
        if chat.stop:
            kwargs.update(stop_strings=chat.stop, tokenizer=self.manager.tokenizer)
        if processor is not None:
            # The grammar decides what may come next; no suppressed token stands in its way.
            kwargs.update(logits_processor=[processor], suppress_tokens=None)

        def begin():
            if chat.prompt is not None:  # a text completion: the prompt as it is
                if self._holds_chat(session):
                    raise APIError(
                        400,
                        "this session holds a chat; a text completion needs a session of "
                        "its own (another prompt_cache_key or user)",
                        param=chat.extra.get("session_field", "prompt_cache_key"),
                        code="invalid_value",
                    )
                ids = self.manager.tokenizer(chat.prompt, return_tensors="pt")["input_ids"]
                stream = self.manager.stream_generate(
                    ids, session, max_new_tokens=max_tokens, **kwargs
                )
                return stream, next(stream, DONE)
            stream = self.manager.stream_chat(
                session,
                chat.messages,
                max_new_tokens=max_tokens,
                tools=chat.tools,
                chat_template_kwargs=chat.template_kwargs,
                settle=False,  # finish() settles on the reply as it was sent
                # A tool call's markers may be special tokens: the parser reads them.
                skip_special_tokens=fmt is None,
                **kwargs,
            )
            return stream, next(stream, DONE)

        try:
            return await run_in_threadpool(begin)
        except ContextLengthError as error:
            param = "prompt" if chat.prompt is not None else "messages"
            message = _context_message(str(error), chat, max_tokens)
            raise APIError(400, message, param=param, code="context_length_exceeded") from None
        except ValueError as error:
            message = str(error)
            param = _argument(message, "prompt" if chat.prompt is not None else "messages")
            raise APIError(400, message, param=param, code="invalid_value") from None
        except TypeError as error:
            message = str(error)
            raise APIError(400, message, param=_argument(message), code="invalid_value") from None

    def _holds_chat(self, session: str) -> bool:
        try:
            return bool(self.manager.messages(session))
        except KeyError:  # no such session (yet, or removed meanwhile)
            return False

    def finish(self, turn: Reply) -> bool:
        """The server's end of a turn, in one call, once its text is read (or
        its client left): the library's end of it (``ReplyStream.end``: the
        commit, the store's write within ``--store-wait``, the settle on the
        reply as the client received it), then the request counted, its slot
        freed, its session handed back to the router and its hold on the
        session's expiry dropped. False if it was finished already."""
        if not turn.finished.acquire(blocking=False):
            return False
        answered, history = False, None
        try:
            turn.stream.close()  # committed: the report and the grammar's verdict are final
            refused = self.grammar_error(turn) is not None
            # A reply its grammar refused is no one's history: the router keeps what the
            # session held before, and it is not settled on (its cache still serves the
            # conversation up to that reply's prompt).
            answered = turn.stream.report is not None and not refused
            if answered and turn.chat.prompt is None:  # a chat's conversation
                history = [*turn.chat.messages, turn.message()]
            report = self._end(turn, history)
            status = "400" if refused else "200" if report is not None else "500"
            self.metrics.requests.labels(status).inc()
            if report is not None:
                self.metrics.observe(report)
        finally:  # whatever failed above, the slot, the router and the expiry are freed
            self.pending.release()
            self.router.release(turn.ns, turn.session, history)
            if answered and turn.chat.prompt is not None:  # a text completion's text
                self.router.remember_text(turn.ns, turn.session, turn.chat.prompt + turn.text)
            self._let_go(turn, "turn")
        return True

    def _end(self, turn: Reply, history: list[dict] | None):
        """``turn.stream.end``: flushed within ``--store-wait`` (after the last
        token: TTFT never pays for it), settled on ``history``. A history the
        template refuses, or that leaves no room for a next turn, is not
        settled on; the turn's report stands."""
        try:
            return turn.stream.end(history, flush_timeout=self.config.store_wait)
        except (ValueError, TypeError) as error:
            logger.debug("kvchat serve: no settle for %s: %s", turn.session, error)
            return turn.stream.report

    def grammar_error(self, turn: Reply) -> APIError | None:
        """The 400 for a reply whose grammar llguidance refused while decoding
        (the processor ended it there), or None."""
        error = turn.grammar.error if turn.grammar is not None else None
        if error is None:
            return None
        return APIError(400, str(error), param=error.param, code="invalid_value")

    def abandon(self, turn: Reply) -> None:
        """A streamed response ended: if its turn was not finished (the client
        left, or the response never started), stop it and finish it on a thread."""
        if not turn.finished.locked():
            turn.stream.cancel()
            threading.Thread(target=self._finish_abandoned, args=(turn,), daemon=True).start()

    def _finish_abandoned(self, turn: Reply) -> None:
        if self.finish(turn) and turn.on_abandoned is not None:
            try:
                turn.on_abandoned()
            except Exception:  # a thread of its own: nobody else would hear of it
                logger.exception("kvchat serve: after the turn of %s its client left", turn.session)

    def sent(self, turn: Reply) -> None:
        """The turn's response ended: sent to its last byte, or its client
        left. Its turn is stopped if unfinished, and once that is finished too,
        the session's idle time (``--session-ttl``) counts from now: a slow
        reader keeps its session while its reply is still being sent."""
        self.abandon(turn)
        self._let_go(turn, "response")

    def _let_go(self, turn: Reply, hold: str) -> None:
        if turn.let_go(hold):
            self.expiry.end(turn.session)


def _vocab_size(model) -> int:
    """The width of the model's logits (can exceed the tokenizer's vocabulary)."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def _context_message(message: str, chat: ChatRequest, max_tokens: int) -> str:
    """The library's context-length message in the request's terms: its field
    (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``) where the
    library says ``max_new_tokens``, and what to do."""
    field = chat.extra.get("max_tokens_field", "max_tokens")
    message = re.sub(r"\bmax_new_tokens\b", field, message)
    if chat.max_tokens is None:
        message += f" (the request sent no {field}: --default-max-tokens {max_tokens} applies)"
    what = "a shorter prompt" if chat.prompt is not None else "fewer or shorter messages"
    return f"{message}; send {what} or a smaller {field}"


def _argument(message: str, default: str | None = None) -> str | None:
    """The request field a library error names first (``tools[0] must be ...``)."""
    match = re.match(r"(messages|tools|chat_template_kwargs|stop)\b", message)
    return match.group(1) if match else default
