"""What every endpoint shares: the app's parts (the manager, its config, the
session router, the turn runner, stored responses, metrics, idle expiry) and
the steps each request takes (its caller, its body, its model, its reply)."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ...manager import SessionManager
from ..errors import APIError
from ..expiry import IdleExpiry
from ..metrics import Metrics
from ..reply import JSONReplyResponse, Reply, StreamedReplyResponse
from ..response_store import ResponseStore
from ..sessions import SessionRouter, namespace
from ..turns import ServerTurns

if TYPE_CHECKING:
    from ..app import ServeConfig


@dataclass
class AppContext:
    """One app's parts, which its endpoints use."""

    manager: SessionManager
    config: ServeConfig
    router: SessionRouter
    metrics: Metrics
    expiry: IdleExpiry
    turns: ServerTurns
    response_store: ResponseStore

    def caller(self, request: Request) -> str:
        """The caller's namespace; 401 without a configured key."""
        if not self.config.api_keys:
            return namespace(None)
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(
                401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        # Compared in constant time, so response timing reveals nothing of a key.
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.config.api_keys):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return namespace(key)

    async def read_json(self, request: Request):
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(
                413,
                f"request body of {declared} bytes exceeds the limit of {limit}",
                code="request_too_large",
            )
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(
                    413,
                    f"request body exceeds the limit of {limit} bytes",
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

    def check_model(self, model: str) -> None:
        if model != self.config.model_name and model not in self.config.model_aliases:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def answer(
        self, turn: Reply, stream: bool, events, body
    ) -> StreamedReplyResponse | JSONResponse:
        """A turn's reply, with its session's header: ``events()`` streamed as
        server-sent events, or, once the turn is finished, ``await body(items)``
        (the reply's items) as JSON."""
        headers = self.turns.session_header(turn)
        if stream:
            return self.streamed(turn, events(), headers)
        try:
            content = await body(await self.collected(turn))
        except BaseException:  # no response of its own: its session is free now
            self.turns.sent(turn)
            raise
        return JSONReplyResponse(content, on_end=lambda: self.turns.sent(turn), headers=headers)

    def streamed(self, turn: Reply, body, headers: dict) -> StreamedReplyResponse:
        """A streamed reply; however it ends, its turn is finished, and its
        session is free once it is sent."""
        return StreamedReplyResponse(
            body,
            on_end=lambda: self.turns.sent(turn),
            media_type="text/event-stream",
            headers=headers,
        )

    async def collected(self, turn: Reply) -> list:
        """The whole reply's items, once its turn is finished; a 400 if its
        grammar was refused while decoding."""
        try:
            items = await run_in_threadpool(turn.collect_items)
        finally:
            await run_in_threadpool(self.turns.finish, turn)
        refused = self.turns.grammar_error(turn)
        if refused is not None:
            raise refused
        return items


def sse(body: dict) -> str:
    """A server-sent event: one ``data:`` line of JSON."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _not_json(constant: str):
    """NaN and Infinity, which Python's json reads but JSON has not (and which
    could never be written back in a session's history)."""
    raise ValueError(f"{constant} is not a JSON value")
