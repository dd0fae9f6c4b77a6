"""``POST /v1/completions``: a text prompt continued as it is, answered whole
or streamed as chunks (``serve/completions.py`` reads the request and shapes
the bodies)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from .. import completions
from ..reply import DONE, Reply
from ..turns import ServerTurns
from .context import AppContext, sse


def register(app: FastAPI, ctx: AppContext) -> None:
    turns = ctx.turns

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        ns = ctx.caller(request)
        chat = completions.parse_request(await ctx.read_json(request))
        ctx.check_model(chat.model)
        turn = await turns.begin(ns, chat, chat.session_key)
        cid = completions.completion_id()

        async def body(_items) -> dict:
            reason = turn.finish_reason(turns.stop_ids)
            return completions.body(cid, chat.model, turn.text, reason, turn.report)

        return await ctx.answer(
            turn, chat.stream, lambda: completion_chunks(turns, turn, cid), body
        )


async def completion_chunks(turns: ServerTurns, turn: Reply, cid: str):
    model, finished = turn.chat.model, False
    try:
        while (items := await run_in_threadpool(turn.next_items)) is not DONE:
            for item in items:
                if item.text:
                    yield sse(completions.chunk(cid, model, item.text))
        await run_in_threadpool(turns.finish, turn)
        finished = True
        yield sse(completions.chunk(cid, model, "", turn.finish_reason(turns.stop_ids)))
        if turn.chat.include_usage and turn.report is not None:
            yield sse(completions.usage_chunk(cid, model, turn.report))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: stop within a token, commit on a thread
            turns.abandon(turn)
