"""The OpenAI-compatible app: every conversation keeps its cache between turns.

Generation runs in kvchat's stream worker threads, never on the event loop,
so requests on different sessions run at once; a client that disconnects
mid-stream closes its stream, which stops generation within a token and keeps
the session exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from importlib import resources

import torch
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._C import SessionBusy
from ..agents import ToolCall, detect
from ..agents.grammar import GrammarError, Grammars
from ..arguments import ContextLengthError
from ..manager import SessionManager
from ..prompting import end_ids
from ..tiers import StoreUnavailable
from . import protocol
from .errors import APIError, api_error_handler
from .expiry import IdleExpiry
from .metrics import Metrics
from .reply import DONE, Reply, TurnStream, tool_format
from .sessions import SessionRouter, namespace

logger = logging.getLogger("kvchat.serve")


@dataclass
class ServeConfig:
    model_name: str
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    max_pending: int = 64  # requests generating or waiting at once; more get 429
    default_max_tokens: int = 512
    session_ttl: float = 24 * 3600.0  # seconds a session may sit unused; 0: forever
    # With a shared store: seconds a reply's end waits for its session's
    # snapshot, so the client's next turn finds it on any replica (0: no wait).
    store_wait: float = 5.0


def _vocab_size(model) -> int:
    """The width of the model's logits (can exceed the tokenizer's vocabulary)."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def create_app(manager: SessionManager, config: ServeConfig) -> FastAPI:
    router = SessionRouter(manager)
    metrics = Metrics(manager)
    expiry = IdleExpiry(manager, router, config.session_ttl)
    metrics.track(expiry, router)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        sweeper = None
        if config.session_ttl > 0:
            sweeper = asyncio.create_task(expiry.run(metrics.expired.inc))
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            # Snapshots still queued for the store are written before exit.
            await asyncio.to_thread(manager.close)

    app = FastAPI(title="kvchat serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.expiry = expiry
    app.state.router = router
    app.add_exception_handler(APIError, api_error_handler)
    stop_ids = end_ids(manager.tokenizer, manager.model.generation_config)
    calls_format = detect(manager.tokenizer)  # the template's tool-call markup, if known
    grammars = Grammars(manager.tokenizer, _vocab_size(manager.model), stop_ids)
    pending = threading.BoundedSemaphore(config.max_pending)
    created = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        body = APIError(error.status_code, str(error.detail), code=code).body()
        return JSONResponse(body, status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception):
        logger.exception("kvchat serve: internal error on %s", request.url.path)
        body = APIError(500, f"internal error: {type(error).__name__}", code="internal_error")
        return JSONResponse(body.body(), status_code=500)

    def caller(request: Request) -> str:
        """The caller's namespace; 401 without a configured key."""
        if not config.api_keys:
            return namespace(None)
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        # Compared in constant time, so response timing reveals nothing of a key.
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in config.api_keys):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return namespace(key)

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise APIError(
                413,
                f"request body of {declared} bytes exceeds the limit of {config.max_body_bytes}",
                code="request_too_large",
            )
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > config.max_body_bytes:
                raise APIError(
                    413,
                    f"request body exceeds the limit of {config.max_body_bytes} bytes",
                    code="request_too_large",
                )
        try:
            return json.loads(bytes(body), parse_constant=_not_json)
        except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
            raise APIError(
                400, f"the request body is not valid JSON: {error}", code="invalid_json"
            ) from None
        except RecursionError:
            raise APIError(
                400, "the request body is not valid JSON: nested too deeply", code="invalid_json"
            ) from None

    # ------------------------------------------------------------ endpoints
    page = resources.files("kvchat.serve").joinpath("static", "index.html").read_text("utf-8")

    @app.get("/", include_in_schema=False)
    async def chat_page():
        """A chat page with no build step: replies stream in, and each turn shows
        what the server reused and prefilled, and the time to first token."""
        return HTMLResponse(page)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        caller(request)
        entry = {
            "id": config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvchat",
        }
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def session_view(session_id: str, internal: str) -> dict:
        info = manager.info(internal)
        return {
            "id": session_id,
            "object": "session",
            "cached_tokens": info.cached_tokens,
            "nbytes": info.nbytes,
            "messages": info.messages,
            "requests": info.requests,
        }

    @app.get("/v1/sessions")
    async def list_sessions(request: Request):
        ns = caller(request)
        own = [i for i in manager.sessions() if router.external(ns, i) is not None]
        # Deleted on another replica (one store round trip for them all): gone here too.
        deleted = await run_in_threadpool(manager.drop_deleted, own)
        for internal in deleted:
            router.forget(internal)
        data = []
        for internal in own:
            session_id = router.external(ns, internal)
            if internal not in deleted:
                try:
                    data.append(session_view(session_id, internal))
                except KeyError:  # removed since the listing began
                    continue
        return {"object": "list", "data": data}

    def own_session(ns: str, session_id: str) -> str:
        internal = router.internal(ns, session_id)
        if internal not in manager.sessions():
            raise APIError(
                404, f"no session {session_id!r}", param="session_id", code="session_not_found"
            )
        return internal

    # ``:path``: a session id may hold "/" (prompt_cache_key "team/a"), sent
    # as it is or percent-encoded; its owner reads and deletes it either way.
    @app.get("/v1/sessions/{session_id:path}")
    async def get_session(session_id: str, request: Request):
        internal = own_session(caller(request), session_id)
        # Deleted on another replica (the shared store says so): gone here too.
        if await run_in_threadpool(manager.drop_if_deleted, internal):
            router.forget(internal)
            raise APIError(
                404, f"no session {session_id!r}", param="session_id", code="session_not_found"
            )
        try:
            last = manager.last_turn(internal)
            return {
                **session_view(session_id, internal),
                "history": manager.messages(internal),
                "last_turn": None if last is None else dataclasses.asdict(last),
            }
        except KeyError:  # removed a moment ago
            raise APIError(
                404, f"no session {session_id!r}", param="session_id", code="session_not_found"
            ) from None

    @app.delete("/v1/sessions/{session_id:path}")
    async def delete_session(session_id: str, request: Request):
        # Not own_session: a session only the shared store holds (another
        # replica's) is deleted too. Removed here and in the store, so on every
        # replica (a network call: off the event loop).
        internal = router.internal(caller(request), session_id)
        try:
            await run_in_threadpool(manager.remove, internal)
        except StoreUnavailable as error:
            if internal not in manager.sessions():  # removed here, not yet in the store
                router.forget(internal)
                expiry.forget(internal)
            raise APIError(503, str(error), param="session_id", code="store_unavailable") from None
        except SessionBusy:
            raise APIError(
                409,
                f"session {session_id!r} is answering a request; try again",
                param="session_id",
                code="session_busy",
            ) from None
        except KeyError:
            raise APIError(
                404, f"no session {session_id!r}", param="session_id", code="session_not_found"
            ) from None
        router.forget(internal)
        expiry.forget(internal)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ns = caller(request)
        chat = protocol.parse_chat_request(await read_json(request))
        if chat.model != config.model_name:
            raise APIError(
                404,
                f"the model {chat.model!r} does not exist; this server serves "
                f"{config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        header = request.headers.get("x-session-id")
        if header is not None and not (0 < len(header) <= 512 and protocol.header_value(header)):
            raise APIError(
                400,
                "X-Session-ID must be 1 to 512 characters of printable ASCII with no space "
                f"at either end (it is sent back as a header), got {header[:64]!r}",
                param="X-Session-ID",
                code="invalid_value",
            )
        explicit = chat.session_key or (header or None)
        fmt = tool_format(chat, calls_format)
        # Built before any session is claimed: a bad schema is a 400 that touches nothing.
        processor = await run_in_threadpool(constrain, chat, fmt) if chat.constrained else None
        if not pending.acquire(blocking=False):
            metrics.requests.labels("429").inc()
            raise APIError(
                429,
                f"more than {config.max_pending} requests are in progress; retry later",
                code="rate_limit_exceeded",
            )
        try:
            session = await claim(ns, explicit, chat.messages)
        except BaseException:
            pending.release()
            raise
        expiry.begin(session)  # until finish(): it never expires while in use
        max_tokens = chat.max_tokens or config.default_max_tokens
        try:
            # Made before the turn runs: a turn is never run for a reply that cannot be sent.
            headers = {"X-Session-ID": router.external(ns, session) or session}
            stream, first = await start_turn(session, chat, max_tokens, fmt, processor)
        except BaseException as error:
            pending.release()
            expiry.end(session)
            released = release_failed(ns, session)
            if not isinstance(error, asyncio.CancelledError):
                await released  # before the error reaches the client, who may retry at once
            raise
        cid = protocol.completion_id()
        turn = Reply(stream, first, chat, max_tokens, session, ns, explicit is None, fmt)
        if chat.stream:
            return TurnStream(
                stream_body(turn, cid),
                on_end=lambda: abandon(turn),
                media_type="text/event-stream",
                headers=headers,
            )
        try:
            await run_in_threadpool(turn.collect)
        finally:
            await run_in_threadpool(finish, turn)
        body = protocol.completion(
            cid, chat.model, turn.message(), turn.finish_reason(stop_ids), turn.report
        )
        return JSONResponse(body, headers=headers)

    async def claim(ns: str, explicit: str | None, messages: list[dict]) -> str:
        """router.claim, off the event loop when it asks the shared store (a
        network call). If the request is cancelled meanwhile (its client
        left), the claim is released as a failed turn once it is made: never
        a session held out of the map for ever."""
        if not manager.tier.shared:
            return router.claim(ns, explicit, messages)
        loop = asyncio.get_running_loop()
        claimed = loop.run_in_executor(None, router.claim, ns, explicit, messages)
        try:
            return await asyncio.shield(claimed)
        except asyncio.CancelledError:

            def release(done) -> None:
                if not done.cancelled() and done.exception() is None:
                    release_failed(ns, done.result())

            claimed.add_done_callback(release)
            raise

    def release_failed(ns: str, session: str) -> asyncio.Future:
        """router.release for a turn that never ran, off the event loop when it
        writes to the shared store (a network call that a hung store stalls)."""
        loop = asyncio.get_running_loop()
        if not manager.tier.shared:
            router.release(ns, session, None)
            done = loop.create_future()
            done.set_result(None)
            return done
        return asyncio.shield(loop.run_in_executor(None, router.release, ns, session, None))

    def constrain(chat: protocol.ChatRequest, fmt):
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
                grammar = grammars.tool_calls(fmt, tools, chat.parallel_tool_calls)
                return grammars.processor(grammar, "tool_choice")
            return grammars.processor(grammars.json_schema(chat.json_schema), "response_format")
        except GrammarError as error:
            raise APIError(400, str(error), param=error.param, code="invalid_value") from None

    async def start_turn(session: str, chat: protocol.ChatRequest, max_tokens: int, fmt, processor):
        """Starts the turn and waits for its first piece, so what is refused
        before generation (a context overflow, say) is an error status."""
        kwargs = dict(chat.generate_kwargs)
        if chat.stop:
            kwargs.update(stop_strings=chat.stop, tokenizer=manager.tokenizer)
        if processor is not None:
            # The grammar decides what may come next; no suppressed token stands in its way.
            kwargs.update(logits_processor=[processor], suppress_tokens=None)

        def begin():
            if chat.seed is not None:
                torch.manual_seed(chat.seed)
            stream = manager.stream_chat(
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
            raise APIError(
                400, str(error), param="messages", code="context_length_exceeded"
            ) from None
        except ValueError as error:
            message = str(error)
            param = _argument(message, "messages")
            raise APIError(400, message, param=param, code="invalid_value") from None
        except TypeError as error:
            message = str(error)
            raise APIError(400, message, param=_argument(message), code="invalid_value") from None

    def finish(turn: Reply) -> None:
        """Waits for the turn to be committed, then counts it and frees its slot."""
        if not turn.finished.acquire(blocking=False):
            return
        report = None
        try:
            turn.stream.close()
            report = turn.stream.report
            if config.store_wait > 0:  # after the last token: TTFT never pays for it
                manager.flush(timeout=config.store_wait, session_id=turn.session)
            metrics.requests.labels("200" if report is not None else "500").inc()
            if report is not None:
                metrics.observe(report)
        finally:  # whatever failed above, the slot, the router and expiry are freed
            pending.release()
            history = None
            if report is not None:
                history = [*turn.chat.messages, turn.message()]
            router.release(turn.ns, turn.session, history)
            expiry.end(turn.session)
        if history is not None:
            settle(turn, history)

    def settle(turn: Reply, history: list[dict]) -> None:
        """Settles the session on the conversation the client received (the
        text a stop string cut short, the tool calls read out of it), for its
        next turn."""
        try:
            manager.settle(
                turn.session,
                history,
                tools=turn.chat.tools,
                chat_template_kwargs=turn.chat.template_kwargs,
            )
        except (KeyError, ValueError, TypeError) as error:  # removed meanwhile, say
            logger.debug("kvchat serve: no settle for %s: %s", turn.session, error)

    def abandon(turn: Reply) -> None:
        """A streamed response ended: if its turn was not finished (the client
        left, or the response never started), stop it and finish it on a thread."""
        if not turn.finished.locked():
            turn.stream.cancel()
            threading.Thread(target=finish, args=(turn,), daemon=True).start()

    async def stream_body(turn: Reply, cid: str):
        model = turn.chat.model
        finished = False
        calls = 0
        try:
            yield _sse(protocol.chunk(cid, model, {"role": "assistant", "content": ""}))
            while True:
                items = await run_in_threadpool(turn.next_items)
                if items is DONE:
                    break
                for item in items:
                    if isinstance(item, ToolCall):
                        for delta in protocol.tool_call_deltas(calls, item):
                            yield _sse(protocol.chunk(cid, model, delta))
                        calls += 1
                    elif item.text:
                        yield _sse(protocol.chunk(cid, model, {"content": item.text}))
            # Committed and released before [DONE], so the client's next turn finds it.
            await run_in_threadpool(finish, turn)
            finished = True
            yield _sse(protocol.chunk(cid, model, {}, turn.finish_reason(stop_ids)))
            if turn.chat.include_usage and turn.stream.report is not None:
                yield _sse(protocol.usage_chunk(cid, model, turn.stream.report))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                # The client went away: stop generating within a token, and let
                # a thread wait for the commit (nothing may block the loop here).
                turn.stream.cancel()
                threading.Thread(target=finish, args=(turn,), daemon=True).start()

    return app


def _argument(message: str, default: str | None = None) -> str | None:
    """The request field a library error names first (``tools[0] must be ...``)."""
    match = re.match(r"(messages|tools|chat_template_kwargs|stop)\b", message)
    return match.group(1) if match else default


def _not_json(constant: str):
    """NaN and Infinity, which Python's json reads but JSON has not (and which
    could never be written back in a session's history)."""
    raise ValueError(f"{constant} is not a JSON value")


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
