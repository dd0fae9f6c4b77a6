"""``/v1/responses``: a Responses request run as a chat turn (continuing the
session of its ``previous_response_id``), answered whole or streamed as named
events; and the stored responses read and deleted."""

from __future__ import annotations

import json
import logging
import reprlib

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
            raise APIError(
                404, f"no response {reprlib.repr(rid)}", param=param, code="response_not_found"
            )
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
            output.close(bool(turn.calls), cut=ending(ctx, turn)[0] == "incomplete")
            return await run_in_threadpool(keep_response, ctx, turn, req, rid, created, ns, output)

        sent = Output()  # a streamed response's items, as they are sent

        def keep_abandoned() -> None:
            """The client left mid-stream: its response is stored all the same,
            unless it never got the response's id (it left before
            response.created) or its grammar was refused (no one's reply)."""
            if not sent.announced or turns.grammar_error(turn) is not None:
                return
            # The open message, and any call cut short, end.
            sent.close(bool(turn.calls), cut=ending(ctx, turn, left=True)[0] == "incomplete")
            keep_response(ctx, turn, req, rid, created, ns, sent, left=True)

        if req.stream:
            turn.on_abandoned = keep_abandoned
        events = lambda: response_events(ctx, turn, req, rid, created, ns, sent)  # noqa: E731
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
                404,
                f"no response {reprlib.repr(response_id)}",
                param="response_id",
                code="response_not_found",
            )
        return {"id": response_id, "object": "response", "deleted": True}


def ending(ctx: AppContext, turn: Reply, left: bool = False) -> tuple[str, str]:
    """A finished turn's response status and, if "incomplete", why: its
    client left before the reply ended (``left``), or max_output_tokens."""
    if left and not turn.ended:
        return "incomplete", "client_disconnected"
    if turn.report is not None and turn.finish_reason(ctx.turns.stop_ids) == "length":
        return "incomplete", "max_output_tokens"
    return "completed", "max_output_tokens"


def keep_response(
    ctx: AppContext,
    turn: Reply,
    req: ResponsesRequest,
    rid: str,
    created: int,
    ns: str,
    output: Output,
    left: bool = False,
) -> dict:
    """The finished response's body, stored when ``store`` (a failed turn is
    not); ``store`` reads false in it if it was not. ``left``: its client
    left mid-stream; unless the reply had ended, it is incomplete, with the
    output written so far."""
    status, reason = ending(ctx, turn, left)
    body = response(req, rid, created, status, output.items, turn.report, reason)
    if req.store and turn.report is not None:
        conversation = [*turn.chat.messages, turn.message()]
        if req.instructions is not None:
            conversation = conversation[1:]  # instructions do not carry over
        try:
            stored = ctx.response_store.put(ns, rid, body, conversation, turn.chat.session_key)
        except StoreUnavailable as error:
            logger.warning("kvchat serve: response %s not stored: %s", rid, error)
            stored = False
        body["store"] = stored
    return body


async def response_events(
    ctx: AppContext,
    turn: Reply,
    req: ResponsesRequest,
    rid: str,
    created: int,
    ns: str,
    output: Output,
):
    turns = ctx.turns

    def read():
        """The next events; on the thread, so ``output`` holds every item read
        even when the client leaves while this runs (turn.on_abandoned stores it)."""
        items = turn.next_items()
        return DONE if items is DONE else output.feed(items)

    finished = False
    try:
        start = response(req, rid, created, "in_progress", [], None)
        yield _event(output.event("response.created", response=start))
        yield _event(output.event("response.in_progress", response=start))
        # A send to a client already gone returns at once, so whether it got
        # the id is known only at the first wait: a client that left while
        # its turn prefilled is stopped there, its response never announced.
        while (events := await run_in_threadpool(read)) is not DONE:
            output.announced = True
            for event in events:
                yield _event(event)
        finished = True

        def end():
            """Finished, then stored before the last events go out, on one
            thread call (which runs to its end even if the client leaves):
            a client that leaves now still finds its response stored. A
            reply its grammar refused is not stored: its stream ends with
            OpenAI's error event."""
            if not turns.finish(turn):
                return None  # finished as abandoned meanwhile: stored by that
            refused = turns.grammar_error(turn)
            if refused is not None:
                return refused, None
            closing = output.close(bool(turn.calls), cut=ending(ctx, turn)[0] == "incomplete")
            return closing, keep_response(ctx, turn, req, rid, created, ns, output)

        ended = await run_in_threadpool(end)
        if ended is None:
            return
        closing, body = ended
        if body is None:
            error = closing.body()["error"]
            fields = {k: error[k] for k in ("code", "message")}
            fields["param"] = responses_param(error["param"])
            yield _event(output.event("error", **fields))
            return
        for event in closing:
            yield _event(event)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield _event(output.event(kind, response=body))
    finally:
        if not finished:  # the client went away: stop within a token, commit on a thread
            turns.abandon(turn)


def _event(body: dict) -> str:
    """A Responses stream event: named, as OpenAI sends them."""
    return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
