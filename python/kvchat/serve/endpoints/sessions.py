"""``/v1/sessions``: a caller's sessions listed, read (with their history and
last turn) and deleted, here and in the shared store."""

from __future__ import annotations

import dataclasses
import reprlib

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..._C import SessionBusy
from ...tiers import StoreUnavailable
from ..errors import APIError
from .context import AppContext


def register(app: FastAPI, ctx: AppContext) -> None:
    manager, router, expiry = ctx.manager, ctx.router, ctx.expiry

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
        ns = ctx.caller(request)
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
            raise _no_session(session_id)
        return internal

    # ``:path``: a session id may hold "/" (prompt_cache_key "team/a"), sent
    # as it is or percent-encoded; its owner reads and deletes it either way.
    @app.get("/v1/sessions/{session_id:path}")
    async def get_session(session_id: str, request: Request):
        internal = own_session(ctx.caller(request), session_id)
        # Deleted on another replica (the shared store says so): gone here too.
        if await run_in_threadpool(manager.drop_if_deleted, internal):
            router.forget(internal)
            raise _no_session(session_id)
        try:
            last = manager.last_turn(internal)
            return {
                **session_view(session_id, internal),
                "history": manager.messages(internal),
                "last_turn": None if last is None else dataclasses.asdict(last),
            }
        except KeyError:  # removed a moment ago
            raise _no_session(session_id) from None

    @app.delete("/v1/sessions/{session_id:path}")
    async def delete_session(session_id: str, request: Request):
        # Not own_session: a session only the shared store holds (another
        # replica's) is deleted too. Removed here and in the store, so on every
        # replica (a network call: off the event loop).
        internal = router.internal(ctx.caller(request), session_id)
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
            raise _no_session(session_id) from None
        router.forget(internal)
        expiry.forget(internal)
        return {"id": session_id, "object": "session.deleted", "deleted": True}


def _no_session(session_id: str) -> APIError:
    return APIError(
        404, f"no session {reprlib.repr(session_id)}", param="session_id", code="session_not_found"
    )
