"""An agent-shaped replay through the Responses API: kvchat serve, continuing
each turn by ``previous_response_id``, against transformers serve, which keeps
no cache and is sent the whole item list every turn (as a client of a server
without ``previous_response_id`` must).

Each seeded conversation: long ``instructions`` (an agent's system prompt), a
task, then turns in which the agent sends back a tool call and the tool's
result (``function_call`` and ``function_call_output`` items) and the model
answers. Streamed through the official ``openai`` client, one conversation at a
time; per turn, the time to the first ``response.output_text.delta`` (client
side) and the ``cached_tokens`` each server reports.

    python benchmarks/serve_agents.py --model smollm2-135m --turns 10
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import openai
from kvchat.tiny import tiny_tokenizer
from serve import OUT, Server, checkpoint, save
from tqdm import tqdm
from workload import make_conversation

SERVERS = ("kvchat", "transformers")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    return parser.parse_args(argv)


def stream_turn(client, **kwargs) -> tuple[float | None, str, dict | None, str | None]:
    """(first text delta's perf_counter, the text, the final usage, the response id)."""
    first, text, usage, rid = None, "", None, None
    for event in client.responses.create(stream=True, **kwargs):
        if event.type == "response.output_text.delta":
            first = first or time.perf_counter()
            text += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            rid = event.response.id
            usage = event.response.usage.model_dump() if event.response.usage else None
    return first, text, usage, rid


def converse(server: Server, conversation, seed: int, reply_tokens: int, rows: list) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600)
    rng = random.Random(seed)
    chained = server.kind == "kvchat"  # only kvchat continues by previous_response_id
    items: list = [{"role": "user", "content": conversation.user_turns[0]}]
    new_items, previous = list(items), None
    for turn in range(len(conversation.user_turns)):
        kwargs = dict(
            model=server.model,
            instructions=conversation.system,
            max_output_tokens=reply_tokens,
            temperature=0,
            input=new_items if chained else items,
        )
        if chained and previous is not None:
            kwargs["previous_response_id"] = previous
        started = time.perf_counter()
        error = None
        try:
            first, text, usage, previous = stream_turn(client, **kwargs)
        except openai.APIError as failure:
            first, text, usage, error = None, "", None, f"{type(failure).__name__}: {failure}"
        details = (usage or {}).get("input_tokens_details") or {}
        rows.append(
            {
                "server": server.kind,
                "conversation": seed,
                "turn": turn + 1,
                "ttft_ms": None if first is None else (first - started) * 1e3,
                "input_tokens": (usage or {}).get("input_tokens"),
                "cached_tokens": details.get("cached_tokens"),
                "error": error and error[:300],
            }
        )
        if error:
            return
        # The agent's move: it calls a tool (as if the model had asked for it)
        # and sends back the call and its result with the next user text.
        call_id = f"call_{seed}_{turn}"
        result = conversation.user_turns[min(turn + 1, len(conversation.user_turns) - 1)]
        new_items = [
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "search",
                "arguments": json.dumps({"query": f"step {turn}", "k": rng.randint(1, 9)}),
            },
            {"type": "function_call_output", "call_id": call_id, "output": result},
        ]
        items += [{"role": "assistant", "content": text}, *new_items]


def run(args) -> dict:
    OUT.mkdir(exist_ok=True)
    path = checkpoint(args.model)
    tokenizer = tiny_tokenizer()
    rows: list[dict] = []
    for kind in args.servers:
        server = Server(kind, path, args.device, args.dtype)
        try:
            warm = make_conversation(tokenizer, 10**6, 2, (50, 60), (10, 20), (4, 4))
            converse(server, warm, 10**6, 4, [])
            for i in tqdm(range(args.conversations), desc=kind):
                conversation = make_conversation(
                    tokenizer, args.seed + i, args.turns, (600, 800), (40, 160), (4, 4)
                )
                converse(server, conversation, args.seed + i, args.reply_tokens, rows)
        finally:
            server.stop()
    return {"model": args.model, "turns": args.turns, "rows": rows}


def summary(result: dict) -> str:
    lines = ["turn " + "".join(f"{s:>30}" for s in SERVERS)]
    medians: dict[str, dict[int, float]] = {}
    for server in SERVERS:
        medians[server] = {}
        for turn in range(1, result["turns"] + 1):
            values = [
                r["ttft_ms"]
                for r in result["rows"]
                if r["server"] == server and r["turn"] == turn and r["ttft_ms"] is not None
            ]
            if values:
                medians[server][turn] = statistics.median(values)
    for turn in range(1, result["turns"] + 1):
        cells = []
        for server in SERVERS:
            cached = [
                r["cached_tokens"]
                for r in result["rows"]
                if r["server"] == server and r["turn"] == turn
            ]
            ttft = medians[server].get(turn)
            shown = "-" if ttft is None else f"{ttft:.1f}"
            cells.append(f"{shown:>18} ({cached[0] if cached else '-'!s:>8})")
        lines.append(f"{turn:>4} " + "".join(cells))
    last = result["turns"]
    if last in medians.get("kvchat", {}) and last in medians.get("transformers", {}):
        ratio = medians["kvchat"][last] / medians["transformers"][last]
        lines.append(f"turn-{last} TTFT kvchat / transformers serve: {ratio:.3f}")
    errors = sorted({r["error"] for r in result["rows"] if r["error"]})
    lines += [f"error: {e}" for e in errors]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    table = "median TTFT ms per turn (cached tokens of the first conversation)\n"
    return save(f"serve-agents-{args.model.replace(':', '-')}", result, table + summary(result))


if __name__ == "__main__":
    main()
