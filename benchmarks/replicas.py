"""Conversations across server replicas: two `kvchat serve` replicas behind a
round-robin client, with and without a shared Redis store (`--store`), against
one replica that holds every session in memory.

Each conversation's turns alternate between the replicas (turn t of
conversation c goes to replica (t + c) mod 2), streaming through the official
``openai`` client with ``prompt_cache_key``. TTFT is the time to the first
streamed content chunk. One checkpoint (``serve.py``'s), a fresh Redis server
started here on a free port, every server alone on the machine in turn.

Two scenarios:

- one conversation after another (the default): a replica without the store
  still holds the conversation as of two turns ago, and prefills two turns;
- busy replicas (``--interleave --replica-sessions 2``): many conversations
  in flight, more than a replica holds, so a replica without the store has
  evicted the conversation by the time it comes back, and prefills it whole.

    python benchmarks/replicas.py --model smollm2-135m --turns 10 --conversations 3
    python benchmarks/replicas.py --model smollm2-135m --turns 10 --conversations 6 \
        --interleave --replica-sessions 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import openai
from kvchat.serve.process import ServerProcess, redis_server
from kvchat.tiny import tiny_tokenizer
from serve import OUT, checkpoint, save
from tqdm import tqdm
from workload import make_conversation

SETUPS = ("one", "two-store", "two-nostore", "one-store")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--reply-tokens", type=int, nargs=2, default=(20, 60))
    parser.add_argument("--from-turn", type=int, default=5, help="the turns the ratios are over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="what the replicas run on: cpu, cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS[:3]))
    parser.add_argument(
        "--interleave", action="store_true", help="all conversations in flight at once"
    )
    parser.add_argument(
        "--replica-sessions",
        type=int,
        default=64,
        help="--max-sessions of each of the two replicas (the one replica holds 64)",
    )
    return parser.parse_args(argv)


def replica(path: Path, name: str, args, *flags: str) -> ServerProcess:
    """`kvchat serve` on the checkpoint; its log goes to benchmarks/out."""

    def command(port: int) -> list[str]:
        argv = [sys.executable, "-m", "kvchat.serve", str(path), "--dtype", args.dtype]
        argv += ["--device", args.device]
        return argv + ["--port", str(port), "--served-model-name", "m", *flags]

    return ServerProcess(command, log=OUT / f"replicas-{name}.log", timeout=600)


class Chat:
    """One conversation, a turn at a time, on whichever replica each turn goes to."""

    def __init__(self, conversation, key: str):
        self.key = key
        self.messages = [{"role": "system", "content": conversation.system}]
        self.turns = list(zip(conversation.user_turns, conversation.reply_tokens, strict=True))

    def turn(self, turn: int, client: openai.OpenAI, which: int, setup: str) -> dict:
        text, reply_tokens = self.turns[turn]
        self.messages.append({"role": "user", "content": text})
        started = time.perf_counter()
        first, last, pieces, usage = None, None, [], None
        stream = client.chat.completions.create(
            model="m",
            messages=self.messages,
            max_tokens=reply_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"prompt_cache_key": self.key},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                last = time.perf_counter()
                pieces.append(chunk.choices[0].delta.content)
            if getattr(chunk, "usage", None):
                usage = chunk.usage
        done = time.perf_counter()
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        return {
            "setup": setup,
            "conversation": self.key,
            "turn": turn + 1,
            "replica": which,
            "ttft_ms": (first - started) * 1e3,
            "turn_ms": (done - started) * 1e3,
            # From the last token to the stream's end: with --store, the snapshot's write.
            "end_ms": (done - last) * 1e3,
            "prompt_tokens": usage.prompt_tokens,
            "generated": usage.completion_tokens,
            "decode_ms_per_token": (last - first) * 1e3 / max(1, usage.completion_tokens - 1),
            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        }


def run(args) -> dict:
    OUT.mkdir(exist_ok=True)
    path = checkpoint(args.model)
    tokenizer = tiny_tokenizer()
    conversations = [
        make_conversation(
            tokenizer, args.seed + i, args.turns, reply_tokens=tuple(args.reply_tokens)
        )
        for i in range(args.conversations)
    ]
    # Interleaved: turn 1 of every conversation, then turn 2 of every one, ...
    # (many conversations in flight); else one conversation after another.
    order = [(c, t) for c in range(args.conversations) for t in range(args.turns)]
    if args.interleave:
        order.sort(key=lambda ct: (ct[1], ct[0]))
    warmup = make_conversation(tokenizer, 10**6, 2, (50, 60), (10, 20), (4, 4))
    rows: list[dict] = []
    for setup in args.setups:
        store = redis_server(maxmemory="2gb") if setup.endswith("-store") else None
        flags = ["--max-sessions", "64"]
        if setup.startswith("two"):
            flags = ["--max-sessions", str(args.replica_sessions)]
        if store is not None:
            flags += ["--store", store.redis_url]
        count = 1 if setup.startswith("one") else 2
        replicas = []
        try:
            for i in range(count):
                replicas.append(replica(path, f"{setup}-{i}", args, *flags))
            clients = [
                openai.OpenAI(base_url=f"{r.url}/v1", api_key="none", timeout=600) for r in replicas
            ]
            # Every replica pays its first-request costs before the figures.
            chat = Chat(warmup, f"warmup-{setup}")
            for t in range(2):
                chat.turn(t, clients[t % count], t % count, "warmup")
            chats = [Chat(c, f"{setup}-{i}") for i, c in enumerate(conversations)]
            for c, t in tqdm(order, desc=setup):
                which = (t + c) % count  # round-robin: each turn on the other replica
                rows.append(chats[c].turn(t, clients[which], which, setup))
        finally:
            for r in replicas:
                r.stop()
            if store is not None:
                store.stop()
    return {
        "model": args.model,
        "turns": args.turns,
        "conversations": args.conversations,
        "interleave": args.interleave,
        "replica_sessions": args.replica_sessions,
        "from_turn": args.from_turn,
        "rows": rows,
    }


def _median(rows, setup, field, turns) -> float:
    return statistics.median(r[field] for r in rows if r["setup"] == setup and r["turn"] in turns)


def format_table(result: dict) -> str:
    rows, turns = result["rows"], range(1, result["turns"] + 1)
    setups = [s for s in SETUPS if any(r["setup"] == s for r in rows)]
    lines = ["median TTFT ms per turn (cached / prompt tokens)"]
    lines.append(" turn" + "".join(f"{s:>28}" for s in setups))
    for t in turns:
        cells = []
        for s in setups:
            ttft = _median(rows, s, "ttft_ms", {t})
            cached = _median(rows, s, "cached_tokens", {t})
            prompt = _median(rows, s, "prompt_tokens", {t})
            cells.append(f"{ttft:>14.1f} ({int(cached):>5}/{int(prompt):>5})")
        lines.append(f"{t:>5}" + "".join(cells))
    late = set(range(result["from_turn"], result["turns"] + 1))
    lines.append(f"\nturns {result['from_turn']}+, medians:")
    for s in setups:
        ttft, decode, end = (
            _median(rows, s, field, late) for field in ("ttft_ms", "decode_ms_per_token", "end_ms")
        )
        lines.append(
            f"  {s:<12} TTFT {ttft:7.1f} ms   decode {decode:5.1f} ms/token   "
            f"last token to end of stream {end:6.1f} ms"
        )
    ttft = {s: _median(rows, s, "ttft_ms", late) for s in setups}
    if {"one", "two-store"} <= set(setups):
        lines.append(f"two-store / one TTFT: {ttft['two-store'] / ttft['one']:.2f}")
    if {"two-nostore", "two-store"} <= set(setups):
        lines.append(f"two-nostore / two-store TTFT: {ttft['two-nostore'] / ttft['two-store']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    name = f"replicas-{args.model.replace(':', '-')}" + ("-busy" if args.interleave else "")
    return save(name, result, format_table(result))


if __name__ == "__main__":
    main()
