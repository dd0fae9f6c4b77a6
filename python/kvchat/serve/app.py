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
import time
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._C import SessionBusy
from ..agents import ToolCall
from ..manager import SessionManager
from ..tiers import StoreUnavailable
from . import completions, protocol, responses
from .errors import APIError, api_error_handler
from .expiry import IdleExpiry
from .metrics import Metrics
from .reply import DONE, Reply, TurnStream
from .response_store import ResponseStore
from .sessions import SessionRouter, namespace
from .turns import TurnRunner

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
    turns = TurnRunner(manager, config, router, metrics, expiry)
    response_store = ResponseStore(manager.tier, config.session_ttl)
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

    def streamed(turn: Reply, body, headers: dict) -> TurnStream:
        """A streamed reply; however it ends, its turn is finished."""
        return TurnStream(
            body,
            on_end=lambda: turns.abandon(turn),
            media_type="text/event-stream",
            headers=headers,
        )

    async def collected(turn: Reply) -> list:
        """The whole reply's items, once its turn is finished."""
        try:
            return await run_in_threadpool(turn.collect_items)
        finally:
            await run_in_threadpool(turns.finish, turn)

    def check_model(model: str) -> None:
        if model != config.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ns = caller(request)
        chat = protocol.parse_chat_request(await read_json(request))
        check_model(chat.model)
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
        turn = await turns.begin(ns, chat, explicit)
        # Made before the turn runs: a turn is never run for a reply that cannot be sent.
        headers = turns.session_header(turn)
        cid = protocol.completion_id()
        if chat.stream:
            return streamed(turn, stream_body(turn, cid), headers)
        await collected(turn)
        reason = turn.finish_reason(turns.stop_ids)
        body = protocol.completion(cid, chat.model, turn.message(), reason, turn.report)
        return JSONResponse(body, headers=headers)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        ns = caller(request)
        chat = completions.parse_request(await read_json(request))
        check_model(chat.model)
        turn = await turns.begin(ns, chat, chat.session_key)
        headers = turns.session_header(turn)
        cid = completions.completion_id()
        if chat.stream:
            return streamed(turn, completion_chunks(turn, cid), headers)
        await collected(turn)
        reason = turn.finish_reason(turns.stop_ids)
        return JSONResponse(
            completions.body(cid, chat.model, turn.text, reason, turn.report), headers=headers
        )

    async def completion_chunks(turn: Reply, cid: str):
        model, finished = turn.chat.model, False
        try:
            while (items := await run_in_threadpool(turn.next_items)) is not DONE:
                for item in items:
                    if item.text:
                        yield _sse(completions.chunk(cid, model, item.text))
            await run_in_threadpool(turns.finish, turn)
            finished = True
            yield _sse(completions.chunk(cid, model, "", turn.finish_reason(turns.stop_ids)))
            if turn.chat.include_usage and turn.report is not None:
                yield _sse(completions.usage_chunk(cid, model, turn.report))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: stop within a token, commit on a thread
                turns.abandon(turn)

    # ------------------------------------------------------- the Responses API
    def stored(ns: str, rid: str, param: str) -> dict:
        """A stored response of this caller's; 404 for another key's or none."""
        try:
            record = response_store.get(ns, rid)
        except StoreUnavailable as error:
            raise APIError(503, str(error), param=param, code="store_unavailable") from None
        if record is None:
            raise APIError(404, f"no response {rid!r}", param=param, code="response_not_found")
        return record

    @app.post("/v1/responses")
    async def create_response(request: Request):
        ns = caller(request)
        req = responses.parse_request(await read_json(request))
        previous, key = None, None
        if req.previous_response_id is not None:
            record = await run_in_threadpool(
                stored, ns, req.previous_response_id, "previous_response_id"
            )
            previous, key = record["conversation"], record.get("session_key")
        chat = req.chat(req.conversation(previous), key)
        check_model(chat.model)
        turn = await turns.begin(ns, chat, chat.session_key)
        headers = turns.session_header(turn)
        rid, created = responses.new_id("resp"), responses.now()
        if req.stream:
            return streamed(turn, response_events(turn, req, rid, created, ns), headers)
        output = responses.Output()
        output.feed(await collected(turn))
        output.close(bool(turn.calls))
        body = await run_in_threadpool(keep_response, turn, req, rid, created, ns, output)
        return JSONResponse(body, headers=headers)

    def keep_response(turn: Reply, req, rid: str, created: int, ns: str, output) -> dict:
        """The finished response's body, stored when ``store`` (a failed turn is not)."""
        status = "completed"
        if turn.report is not None and turn.finish_reason(turns.stop_ids) == "length":
            status = "incomplete"
        body = responses.response(req, rid, created, status, output.items, turn.report)
        if req.store and turn.report is not None:
            conversation = [*turn.chat.messages, turn.message()]
            if req.instructions is not None:
                conversation = conversation[1:]  # instructions do not carry over
            try:
                response_store.put(ns, rid, body, conversation, turn.chat.session_key)
            except StoreUnavailable as error:
                logger.warning("kvchat serve: response %s not stored: %s", rid, error)
        return body

    async def response_events(turn: Reply, req, rid: str, created: int, ns: str):
        output = responses.Output()
        finished = False
        try:
            start = responses.response(req, rid, created, "in_progress", [], None)
            yield _event(output.event("response.created", response=start))
            yield _event(output.event("response.in_progress", response=start))
            while True:
                items = await run_in_threadpool(turn.next_items)
                if items is DONE:
                    break
                for event in output.feed(items):
                    yield _event(event)
            await run_in_threadpool(turns.finish, turn)
            finished = True
            for event in output.close(bool(turn.calls)):
                yield _event(event)
            body = await run_in_threadpool(keep_response, turn, req, rid, created, ns, output)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield _event(output.event(kind, response=body))
        finally:
            if not finished:  # the client went away: stop within a token, commit on a thread
                turns.abandon(turn)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        ns = caller(request)
        record = await run_in_threadpool(stored, ns, response_id, "response_id")
        return record["response"]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        ns = caller(request)
        try:
            deleted = await run_in_threadpool(response_store.delete, ns, response_id)
        except StoreUnavailable as error:
            raise APIError(503, str(error), param="response_id", code="store_unavailable") from None
        if not deleted:
            raise APIError(
                404, f"no response {response_id!r}", param="response_id", code="response_not_found"
            )
        return {"id": response_id, "object": "response", "deleted": True}

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
            await run_in_threadpool(turns.finish, turn)
            finished = True
            yield _sse(protocol.chunk(cid, model, {}, turn.finish_reason(turns.stop_ids)))
            if turn.chat.include_usage and turn.stream.report is not None:
                yield _sse(protocol.usage_chunk(cid, model, turn.stream.report))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: stop within a token, commit on a thread
                turns.abandon(turn)

    return app


def _not_json(constant: str):
    """NaN and Infinity, which Python's json reads but JSON has not (and which
    could never be written back in a session's history)."""
    raise ValueError(f"{constant} is not a JSON value")


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _event(body: dict) -> str:
    """A Responses stream event: named, as OpenAI sends them."""
    return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
