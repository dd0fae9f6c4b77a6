"""Time to first token where the client sees it: the first streamed content
chunk, against the server's own prefill time, on replies whose first word is
many tokens (as code, JSON, URLs and tool calls are).

The model writes one word per reply: every token whose text holds whitespace
(or is not whole characters) is suppressed, so a streamer that waits for a
space sends nothing until the reply ends. Per turn, through the ``openai``
client against ``kvchat serve``: the client's TTFT, the server's
``prefill_ms`` (its time to the first token, read back from
``GET /v1/sessions/{id}``), and one token's decode time
(``(total_ms - prefill_ms) / (generated - 1)``). The gap between the first two
should be at most about one token's decode.

    python benchmarks/first_piece.py --model smollm2-135m --turns 6 --reply-tokens 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai
import torch
from kvchat.serve.process import ServerProcess
from kvchat.tiny import tiny_tokenizer
from workload import PRESETS, load_model, make_conversation

OUT = Path(__file__).parent / "out"
RESULTS = Path(__file__).parent / "results"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(PRESETS))
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="kvchat", help="names this run in the output file")
    return parser.parse_args(argv)


def one_word_checkpoint(name: str) -> Path:
    """The preset's random weights with a generation config that writes one
    long word per reply (no whitespace token, no early end)."""
    path = OUT / f"ckpt-{name}-one-word"
    if (path / "config.json").exists():
        return path
    model, tokenizer = load_model(name, torch.float32, "cpu")
    vocab = model.config.get_text_config().vocab_size
    # No whitespace, and no token that is not whole characters on its own:
    # code and JSON are such text, and a random model's stray bytes would be
    # held back as characters not yet complete (IncrementalText).
    split = [
        i
        for i in range(len(tokenizer))
        if any(c.isspace() or c == "\ufffd" for c in tokenizer.decode([i]))
    ]
    model.generation_config.suppress_tokens = sorted(
        {*split, *range(len(tokenizer), vocab), tokenizer.eos_token_id}
    )
    model.generation_config.do_sample = False
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(args) -> dict:
    OUT.mkdir(exist_ok=True)
    path = one_word_checkpoint(args.model)
    server = ServerProcess(
        lambda port: [sys.executable, "-m", "kvchat.serve", str(path), "--port", str(port)]
    )
    rows = []
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600)
        conversation = make_conversation(tiny_tokenizer(), args.seed, args.turns + 1)
        messages = [{"role": "system", "content": conversation.system}]
        for turn, text in enumerate(conversation.user_turns):
            messages.append({"role": "user", "content": text})
            started = time.perf_counter()
            first, pieces = None, []
            for chunk in client.chat.completions.create(
                model=str(path),
                messages=messages,
                max_tokens=args.reply_tokens,
                temperature=0,
                stream=True,
                extra_body={"prompt_cache_key": "first-piece"},
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    pieces.append(chunk.choices[0].delta.content)
            session = httpx.get(f"{server.url}/v1/sessions/first-piece", timeout=60).json()
            last = session["last_turn"]
            decode_ms = (last["total_ms"] - last["prefill_ms"]) / max(
                last["generated_tokens"] - 1, 1
            )
            if turn > 0:  # turn 1 warms the server up
                rows.append(
                    {
                        "turn": turn + 1,
                        "prompt_tokens": last["prompt_tokens"],
                        "reused_tokens": last["reused_tokens"],
                        "client_ttft_ms": (first - started) * 1e3,
                        "server_prefill_ms": last["prefill_ms"],
                        "decode_ms_per_token": decode_ms,
                        "pieces": len(pieces),
                        "generated": last["generated_tokens"],
                    }
                )
            messages.append({"role": "assistant", "content": "".join(pieces)})
    finally:
        server.stop()
    return {"model": args.model, "label": args.label, "rows": rows}


def format_table(result: dict) -> str:
    lines = [
        f"first piece, {result['model']} ({result['label']}): one-word replies, streamed",
        f"{'turn':>4} {'prompt':>6} {'client TTFT':>11} {'server prefill':>14} "
        f"{'gap':>8} {'1 token':>8} {'pieces':>6}",
    ]
    for r in result["rows"]:
        gap = r["client_ttft_ms"] - r["server_prefill_ms"]
        lines.append(
            f"{r['turn']:>4} {r['prompt_tokens']:>6} {r['client_ttft_ms']:>9.1f}ms "
            f"{r['server_prefill_ms']:>12.1f}ms {gap:>6.1f}ms {r['decode_ms_per_token']:>6.1f}ms "
            f"{r['pieces']:>3}/{r['generated']}"
        )
    gaps = [r["client_ttft_ms"] - r["server_prefill_ms"] for r in result["rows"]]
    decode = statistics.median(r["decode_ms_per_token"] for r in result["rows"])
    lines.append(
        f"median gap {statistics.median(gaps):.1f} ms = "
        f"{statistics.median(gaps) / decode:.2f} x one token's decode ({decode:.1f} ms)"
    )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(format_table(result))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"first-piece-{args.model}-{args.label}-cpu.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
