"""``POST /v1/chat/completions``: a chat turn on the session the request
names (``prompt_cache_key``, ``user`` or the ``X-Session-ID`` header) or the
one its conversation continues, answered whole or streamed as chunks."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ...agents import ToolCall
from ...agents.streamed_calls import CallArguments, CallStart
from .. import chat_response
from ..chat_request import header_value, parse_chat_request
from ..errors import APIError
from ..reply import DONE, Reply
from ..turns import ServerTurns
from .context import AppContext, sse


def register(app: FastAPI, ctx: AppContext) -> None:
    turns = ctx.turns

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ns = ctx.caller(request)
        chat = parse_chat_request(await ctx.read_json(request))
        ctx.check_model(chat.model)
        header = request.headers.get("x-session-id")
        if header is not None and not (0 < len(header) <= 512 and header_value(header)):
            raise APIError(
                400,
                "X-Session-ID must be 1 to 512 characters of printable ASCII with no space "
                f"at either end (it is sent back as a header), got {header[:64]!r}",
                param="X-Session-ID",
                code="invalid_value",
            )
        explicit = chat.session_key or (header or None)
        turn = await turns.begin(ns, chat, explicit)
        cid = chat_response.completion_id()

        async def body(_items) -> dict:
            reason = turn.finish_reason(turns.stop_ids)
            return chat_response.completion(cid, chat.model, turn.message(), reason, turn.report)

        return await ctx.answer(turn, chat.stream, lambda: stream_body(turns, turn, cid), body)


async def stream_body(turns: ServerTurns, turn: Reply, cid: str):
    model = turn.chat.model
    finished = False
    calls, started = 0, 0  # calls given out; of them, started as they were written
    try:
        yield sse(chat_response.chunk(cid, model, {"role": "assistant", "content": ""}))
        while True:
            items = await run_in_threadpool(turn.next_items)
            if items is DONE:
                break
            for item in items:
                if isinstance(item, CallStart):
                    yield sse(chat_response.chunk(cid, model, chat_response.call_start(item)))
                    started += 1
                elif isinstance(item, CallArguments):
                    delta = chat_response.call_arguments(item.index, item.text)
                    yield sse(chat_response.chunk(cid, model, delta))
                elif isinstance(item, ToolCall):
                    if calls >= started:  # not given out as it was written
                        for delta in chat_response.tool_call_deltas(calls, item):
                            yield sse(chat_response.chunk(cid, model, delta))
                    calls += 1
                elif item.text:
                    yield sse(chat_response.chunk(cid, model, {"content": item.text}))
        # Committed and released before [DONE], so the client's next turn finds it.
        await run_in_threadpool(turns.finish, turn)
        finished = True
        refused = turns.grammar_error(turn)
        if refused is not None:  # the status is sent: the error ends the stream, as OpenAI's do
            yield sse(refused.body())
            return
        yield sse(chat_response.chunk(cid, model, {}, turn.finish_reason(turns.stop_ids)))
        if turn.chat.include_usage and turn.stream.report is not None:
            yield sse(chat_response.usage_chunk(cid, model, turn.stream.report))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away: stop within a token, commit on a thread
            turns.abandon(turn)
