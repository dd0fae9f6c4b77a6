"""What the server says of itself: the chat page at ``/``, ``/health``,
``/v1/models`` and ``/metrics``."""

from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from .context import AppContext


def register(app: FastAPI, ctx: AppContext) -> None:
    created = int(time.time())
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
        ctx.caller(request)
        entry = {
            "id": ctx.config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvchat",
        }
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def prometheus():
        # Off the event loop: a scrape may ask the shared store (stored responses).
        text = await run_in_threadpool(generate_latest, ctx.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)
