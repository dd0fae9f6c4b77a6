"""``/v1/responses``: a Responses request run as a chat turn (continuing the
session of its ``previous_response_id``), answered whole or streamed as named
events; and the stored responses read and deleted."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ...agents.streamed_calls import CallArguments, CallStart
from ...tiers import StoreUnavailable
from ..errors import APIError
from ..reply import DONE, Reply
from ..responses_output import Output, new_id, now, response
from ..responses_request import ResponsesRequest, parse_request, responses_param
from .context import AppContext

logger = logging.getLogger("kvchat.serve")


def register(app: FastAPI, ctx: AppContext) -> None:
    turns, response_store = ctx.turns, ctx.response_store

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
        ns = ctx.caller(request)
        req = parse_request(await ctx.read_json(request))
        previous, key = None, None
        if req.previous_response_id is not None:
            record = await run_in_threadpool(
                stored, ns, req.previous_response_id, "previous_response_id"
            )
            previous, key = record["conversation"], record.get("session_key")
        chat = req.chat(req.conversation(previous), key)
        ctx.check_model(chat.model)
        try:
            turn = await turns.begin(ns, chat, chat.session_key)
        except APIError as error:  # a grammar's 400 names the field as sent (text.format)
            error.param = responses_param(error.param)
            raise
        rid, created = new_id("resp"), now()

        async def body(items) -> dict:
            output = Output()
            # Answered whole: a call is given out once read, never as it was written.
            output.feed([i for i in items if not isinstance(i, (CallStart, CallArguments))])
            output.close(bool(turn.calls))
            return await run_in_threadpool(keep_response, ctx, turn, req, rid, created, ns, output)

        events = lambda: response_events(ctx, turn, req, rid, created, ns)  # noqa: E731
        try:
            return await ctx.answer(turn, req.stream, events, body)
        except APIError as error:  # a grammar refused while decoding
            error.param = responses_param(error.param)
            raise

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        ns = ctx.caller(request)
        record = await run_in_threadpool(stored, ns, response_id, "response_id")
        return record["response"]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        ns = ctx.caller(request)
        try:
            deleted = await run_in_threadpool(response_store.delete, ns, response_id)
        except StoreUnavailable as error:
            raise APIError(503, str(error), param="response_id", code="store_unavailable") from None
        if not deleted:
            raise APIError(
                404, f"no response {response_id!r}", param="response_id", code="response_not_found"
            )
        return {"id": response_id, "object": "response", "deleted": True}


def keep_response(
    ctx: AppContext, turn: Reply, req: ResponsesRequest, rid: str, created: int, ns: str, output
) -> dict:
    """The finished response's body, stored when ``store`` (a failed turn is not)."""
    status = "completed"
    if turn.report is not None and turn.finish_reason(ctx.turns.stop_ids) == "length":
        status = "incomplete"
    body = response(req, rid, created, status, output.items, turn.report)
    if req.store and turn.report is not None:
        conversation = [*turn.chat.messages, turn.message()]
        if req.instructions is not None:
            conversation = conversation[1:]  # instructions do not carry over
        try:
            ctx.response_store.put(ns, rid, body, conversation, turn.chat.session_key)
        except StoreUnavailable as error:
            logger.warning("kvchat serve: response %s not stored: %s", rid, error)
    return body


async def response_events(
    ctx: AppContext, turn: Reply, req: ResponsesRequest, rid: str, created: int, ns: str
):
    turns = ctx.turns
    output = Output()
    finished = False
    try:
        start = response(req, rid, created, "in_progress", [], None)
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
        refused = turns.grammar_error(turn)
        if refused is not None:  # OpenAI's error event ends the stream; nothing is stored
            error = refused.body()["error"]
            fields = {k: error[k] for k in ("code", "message")}
            fields["param"] = responses_param(error["param"])
            yield _event(output.event("error", **fields))
            return
        for event in output.close(bool(turn.calls)):
            yield _event(event)
        body = await run_in_threadpool(keep_response, ctx, turn, req, rid, created, ns, output)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield _event(output.event(kind, response=body))
    finally:
        if not finished:  # the client went away: stop within a token, commit on a thread
            turns.abandon(turn)


def _event(body: dict) -> str:
    """A Responses stream event: named, as OpenAI sends them."""
    return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
