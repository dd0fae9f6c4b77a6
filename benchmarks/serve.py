"""Multi-turn chat through OpenAI-compatible servers: kvchat serve against
transformers serve (default path and --continuous-batching), same checkpoint.

Seeded conversations are replayed through the official ``openai`` client,
streaming, N at a time. Per turn: TTFT (first streamed content chunk), the
whole turn's time, generated tokens and ``usage.prompt_tokens_details.
cached_tokens`` where the server reports it. Every server runs alone, one
after the other, on the same machine.

    python benchmarks/serve.py --model smollm2-135m --turns 10 --concurrency 1 4
    python benchmarks/serve.py --model tiny:lfm2 --turns 10 --concurrency 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
import torch
from kvchat.serve.process import ServerProcess
from kvchat.tiny import FAMILIES, tiny_model, tiny_tokenizer, words_only
from tqdm import tqdm
from workload import PRESETS, load_model, make_conversation

OUT = Path(__file__).parent / "out"
# kvchat-no-settle: kvchat serve --no-settle, for what settling between turns
# costs the other conversations' turns on a busy server.
SERVERS = ("kvchat", "kvchat-no-settle", "transformers", "transformers-cb")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help=f"{sorted(PRESETS)} or tiny:FAMILY")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--reply-tokens", type=int, nargs=2, default=(20, 60))
    parser.add_argument(
        "--think",
        type=float,
        default=0.0,
        help="seconds between a reply and the next request of its conversation",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="what the servers run on: cpu, cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    return parser.parse_args(argv)


def save(name: str, result: dict, table: str) -> dict:
    """Prints ``table`` and writes ``result`` to OUT/NAME.json; returns ``result``."""
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(table)
    print(f"\nwrote {OUT / name}.json")
    return result


def checkpoint(name: str) -> Path:
    """A checkpoint directory both servers load: the preset's random weights, the
    tiny tokenizer and its ChatML template, and a generation config that writes
    whole words and never ends early (replies are exactly max_tokens long)."""
    path = OUT / f"ckpt-{name.replace(':', '-')}"
    if (path / "config.json").exists():
        return path
    if name.startswith("tiny:"):
        family = name.partition(":")[2]
        if family not in FAMILIES:
            raise SystemExit(f"--model tiny:FAMILY takes one of {FAMILIES}")
        tokenizer = tiny_tokenizer()
        model = tiny_model(family, "small", dtype=torch.float32, seed=0, tokenizer=tokenizer)
    else:
        model, tokenizer = load_model(name, torch.float32, "cpu")
    suppress = words_only(tokenizer, model.config.get_text_config().vocab_size)
    model.generation_config.suppress_tokens = suppress + [tokenizer.eos_token_id]
    model.generation_config.do_sample = False
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Server(ServerProcess):
    def __init__(self, kind: str, path: Path, device: str = "cpu", dtype: str = "float32"):
        self.kind, self.model = kind, str(path)

        def command(port: int) -> list[str]:
            if kind.startswith("kvchat"):
                argv = [sys.executable, "-m", "kvchat.serve", str(path), "--dtype", dtype]
                argv += ["--no-settle"] if kind == "kvchat-no-settle" else []
                return argv + ["--device", device, "--port", str(port), "--max-sessions", "64"]
            argv = [shutil.which("transformers") or "transformers", "serve", str(path)]
            argv += ["--port", str(port), "--host", "127.0.0.1", "--device", device]
            argv += ["--dtype", dtype]
            return argv + (["--continuous-batching"] if kind == "transformers-cb" else [])

        # transformers serve's /v1/models can 500 without a hub cache; /health is polled.
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        super().__init__(command, log=OUT / f"serve-{kind}.log", env=env, timeout=600)


def stream_turn(client, model: str, messages, max_tokens: int, extra_body=None):
    """One greedy streamed chat completion, read to its end: when its first
    content arrived (perf_counter), its pieces, its usage, and the last
    ``timings`` a chunk carried (llama-server's server-side figures)."""
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra_body,
    )
    first, pieces, usage, timings = None, [], None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        usage = getattr(chunk, "usage", None) or usage
        timings = (chunk.model_extra or {}).get("timings") or timings
    return first, pieces, usage, timings


def converse(server: Server, conversation, key: str, rows: list, lock, think=0.0) -> None:
    """One conversation, turn after turn; ``think`` seconds between a reply and
    the next request (a user reading, an agent running its tool)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600)
    messages = [{"role": "system", "content": conversation.system}]
    for turn, (text, reply_tokens) in enumerate(
        zip(conversation.user_turns, conversation.reply_tokens, strict=True)
    ):
        messages.append({"role": "user", "content": text})
        started = time.perf_counter()
        first, pieces, usage, error = None, [], None, None
        try:
            # Only kvchat keys sessions; the others get the plain request.
            extra = {"prompt_cache_key": key} if server.kind.startswith("kvchat") else None
            first, pieces, usage, _ = stream_turn(
                client, server.model, messages, reply_tokens, extra
            )
        except openai.APIError as failure:
            error = f"{type(failure).__name__}: {failure}"[:300]
        done = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        row = {
            "server": server.kind,
            "conversation": key,
            "turn": turn + 1,
            "ttft_ms": None if first is None else (first - started) * 1e3,
            "turn_ms": (done - started) * 1e3,
            "generated": getattr(usage, "completion_tokens", None) if usage else len(pieces),
            "prompt_tokens": getattr(usage, "prompt_tokens", None) if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
            "error": error,
        }
        with lock:
            rows.append(row)
        if error:
            return
        messages.append({"role": "assistant", "content": "".join(pieces)})
        time.sleep(think)


def _settling(server: Server) -> dict[str, float]:
    """kvchat's settling counters so far, from /metrics (cumulative per server)."""
    import httpx

    found = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("kvchat_settle") and not name.endswith("_created"):
            found[name.removeprefix("kvchat_").removesuffix("_total")] = float(value)
    return found


def run(args) -> dict:
    OUT.mkdir(exist_ok=True)
    path = checkpoint(args.model)
    tokenizer = tiny_tokenizer()
    rows: list[dict] = []
    runs: list[dict] = []
    lock = threading.Lock()
    for kind in args.servers:
        server = Server(kind, path, args.device, args.dtype)
        try:
            # One warm-up turn, so no server pays its first-request costs in the figures.
            converse(
                server,
                make_conversation(tokenizer, 10**6, 1, (50, 60), (10, 20), (4, 4)),
                "warmup",
                [],
                lock,
            )
            for concurrency in args.concurrency:
                conversations = [
                    make_conversation(
                        tokenizer, args.seed + i, args.turns, reply_tokens=tuple(args.reply_tokens)
                    )
                    for i in range(concurrency)
                ]
                before = len(rows)
                started = time.perf_counter()
                threads = [
                    threading.Thread(
                        target=converse,
                        args=(server, c, f"{kind}-{concurrency}-{i}", rows, lock, args.think),
                    )
                    for i, c in enumerate(conversations)
                ]
                with tqdm(total=concurrency * args.turns, desc=f"{kind} x{concurrency}") as bar:
                    for t in threads:
                        t.start()
                    while any(t.is_alive() for t in threads):
                        bar.n = len(rows) - before
                        bar.refresh()
                        time.sleep(0.5)
                    bar.n = len(rows) - before
                    bar.refresh()
                wall = time.perf_counter() - started
                mine = rows[before:]
                for r in mine:
                    r["concurrency"] = concurrency
                generated = sum(r["generated"] or 0 for r in mine if not r["error"])
                runs.append(
                    {
                        "server": kind,
                        "concurrency": concurrency,
                        "wall_s": wall,
                        "generated": generated,
                        "tokens_per_s": generated / wall,
                        "errors": sorted({r["error"] for r in mine if r["error"]}),
                        "settling": _settling(server) if kind.startswith("kvchat") else None,
                    }
                )
        finally:
            server.stop()
    return {"model": args.model, "turns": args.turns, "rows": rows, "runs": runs}


def _median_by_turn(rows, server, concurrency, field) -> dict[int, float]:
    out = {}
    for turn in sorted({r["turn"] for r in rows}):
        values = [
            r[field]
            for r in rows
            if r["server"] == server
            and r["concurrency"] == concurrency
            and r["turn"] == turn
            and r[field] is not None
            and not r["error"]
        ]
        if values:
            out[turn] = statistics.median(values)
    return out


def format_table(result: dict) -> str:
    rows, lines = result["rows"], []
    servers = sorted({r["server"] for r in rows}, key=SERVERS.index)
    for concurrency in sorted({r["concurrency"] for r in rows}):
        lines.append(f"\nconcurrency {concurrency}: median TTFT ms per turn (cached tokens)")
        lines.append(" turn " + "".join(f"{s:>26}" for s in servers))
        ttft = {s: _median_by_turn(rows, s, concurrency, "ttft_ms") for s in servers}
        cached = {s: _median_by_turn(rows, s, concurrency, "cached_tokens") for s in servers}
        for turn in range(1, result["turns"] + 1):
            cells = []
            for s in servers:
                if turn not in ttft[s]:
                    cells.append(f"{'failed':>26}")
                    continue
                c = cached[s].get(turn)
                cells.append(f"{ttft[s][turn]:>16.1f} ({'-' if c is None else int(c)!s:>6})")
            lines.append(f"{turn:>5} " + "".join(cells))
        if "kvchat" in ttft:
            for s in servers[1:]:
                last = max(ttft[s], default=None)
                if last == result["turns"]:
                    ratio = ttft[s][last] / ttft["kvchat"][last]
                    lines.append(f"turn-{last} TTFT {s} / kvchat: {ratio:.2f}")
                common = [t for t in ttft[s] if t >= 2 and t in ttft["kvchat"]]
                if common:
                    worst = max(ttft["kvchat"][t] / ttft[s][t] for t in common)
                    lines.append(f"worst turn >= 2, TTFT kvchat / {s}: {worst:.2f}")
    lines.append("\nserver            concurrency  tokens/s   wall s   errors")
    for run in result["runs"]:
        errors = "; ".join(run["errors"])[:80] or "-"
        lines.append(
            f"{run['server']:<17} {run['concurrency']:>11} {run['tokens_per_s']:>9.2f} "
            f"{run['wall_s']:>8.1f}   {errors}"
        )
        if run.get("settling"):
            counts = ", ".join(f"{k} {v:g}" for k, v in run["settling"].items())
            lines.append(f"  settling so far: {counts}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    name = f"serve-{args.model.replace(':', '-')}"
    if "kvchat-no-settle" in args.servers:  # the settling comparison: its own file
        name += "-settle"
    return save(name, result, format_table(result))


if __name__ == "__main__":
    main()
