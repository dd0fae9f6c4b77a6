"""The OpenAI-compatible app: every conversation keeps its cache between turns.

Generation runs in kvchat's stream worker threads, never on the event loop,
so requests on different sessions run at once; a client that disconnects
mid-stream closes its stream, which stops generation within a token and keeps
the session exact.

This module builds the app's parts and its error handlers; the endpoints are
in ``endpoints/``, one module per family.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..manager import SessionManager
from ..units import format_bytes
from .endpoints import chat, completions, responses, server, sessions
from .endpoints.context import AppContext
from .errors import APIError, api_error_handler
from .expiry import IdleExpiry
from .metrics import Metrics
from .sessions import SessionRouter
from .store import ResponseLimits, server_store
from .turns import ServerTurns

logger = logging.getLogger("kvchat.serve")


@dataclass
class ServeConfig:
    model_name: str
    model_aliases: tuple[str, ...] = ()  # other ids a request may send for the model
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    max_pending: int = 64  # requests generating or waiting at once; more get 429
    default_max_tokens: int = 512
    session_ttl: float = 24 * 3600.0  # seconds a session may sit unused; 0: forever
    # With a shared store: seconds a reply's end waits for its session's
    # snapshot, so the client's next turn finds it on any replica (0: no wait).
    store_wait: float = 5.0
    # Stored responses each API key keeps, newest first: at most this many, and bytes.
    responses_per_key: int = 1000
    response_bytes_per_key: int = 64 * 2**20
    # Template variables every chat turn gets under its own chat_template_kwargs.
    chat_template_kwargs: dict = field(default_factory=dict)


def create_app(manager: SessionManager, config: ServeConfig) -> FastAPI:
    """The app; ValueError for a shared tier that keeps no stored responses
    or routes (serve/store.py)."""
    limits = ResponseLimits(
        per_key=config.responses_per_key,
        bytes_per_key=config.response_bytes_per_key,
        ttl=config.session_ttl if config.session_ttl > 0 else None,
    )
    store = server_store(manager.tier, limits)
    logger.info(
        "stored responses kept in %s: each API key's newest %d, at most %s",
        "this replica's memory" if store.routes is None else f"the shared store ({store.where})",
        limits.per_key,
        format_bytes(limits.bytes_per_key),
    )
    router = SessionRouter(manager, store.routes)
    metrics = Metrics(manager)
    expiry = IdleExpiry(manager, router, config.session_ttl)
    metrics.track(expiry, router)
    metrics.track_responses(store.responses)

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
    ctx = AppContext(
        manager=manager,
        config=config,
        router=router,
        metrics=metrics,
        expiry=expiry,
        turns=ServerTurns(manager, config, router, metrics, expiry),
        response_store=store.responses,
    )

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

    # The OpenAPI schema lists the routes in the order they are registered here.
    for family in (server, sessions, chat, completions, responses):
        family.register(app, ctx)
    return app
