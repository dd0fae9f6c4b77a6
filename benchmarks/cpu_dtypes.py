"""Which weights a CPU user should run: SmolLM2-135M-Instruct's real weights in
float32, bfloat16, with int8 weight-only linear layers (torchao's
``Int8WeightOnlyConfig``: int8 weights and scales, float32 activations), and
with int8 dynamically quantized linear layers
(``torch.ao.quantization.quantize_dynamic``: int8 weights, activations
quantized per forward), each through kvchat on one conversation.

Every variant answers the same prompts: the history is float32's replies, so
prompts are equal and each turn's time compares like with like. Per variant:
time to first token per turn (kvchat's, and plain ``generate``'s on turn 1 and
the last turn), decode tokens/s, resident weight bytes, and how many replies
equal float32's token for token (bfloat16 and int8 round differently, so a
reply may depart; the table says how often).

    python benchmarks/cpu_dtypes.py --turns 6 --max-new-tokens 32      # make bench-cpu-dtypes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from kvchat import SessionManager
from kvchat.demo import REAL_SYSTEM_PROMPT, REAL_USER_TURNS
from kvchat.pretrained import load_pretrained, smollm2_path
from kvchat.prompting import render_prompt
from kvchat.timing import FirstTokenTimer
from machine import describe
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("float32", "bfloat16", "int8-weight-only", "int8-dynamic")


def load(variant: str):
    model, tokenizer = load_pretrained(smollm2_path())
    if variant == "bfloat16":
        model = model.to(torch.bfloat16)
    elif variant == "int8-weight-only":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig())
    elif variant == "int8-dynamic":
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return model.eval(), tokenizer


def _bytes(tensor: torch.Tensor) -> int:
    """A tensor's bytes; a tensor subclass's (torchao's) are its inner tensors'."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(model) -> int:
    state = model.state_dict()
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += _bytes(value)
        elif isinstance(value, tuple):  # a quantized linear's packed (weight, bias)
            total += sum(t.numel() * t.element_size() for t in value if isinstance(t, torch.Tensor))
    return total


def plain_ttft(model, prompt, max_new_tokens: int) -> float:
    timer = FirstTokenTimer()
    model.generate(prompt[None], **timer.attach(dict(max_new_tokens=1, do_sample=False)))
    return timer.prefill_ms


def run_variant(variant: str, history: list[dict] | None, args) -> dict:
    model, tokenizer = load(variant)
    manager = SessionManager(model, tokenizer)
    messages = [{"role": "system", "content": REAL_SYSTEM_PROMPT}]
    rows, replies = [], []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": REAL_USER_TURNS[turn % len(REAL_USER_TURNS)]})
        started = time.perf_counter()
        reply = manager.chat("s", messages, max_new_tokens=args.max_new_tokens)
        wall_ms = (time.perf_counter() - started) * 1e3
        report = manager.last_turn("s")
        decode_s = (report.total_ms - report.prefill_ms) / 1e3
        rows.append(
            {
                "turn": turn + 1,
                "prompt_tokens": report.prompt_tokens,
                "reused_tokens": report.reused_tokens,
                "ttft_ms": report.prefill_ms,
                "decode_tok_s": (report.generated_tokens - 1) / decode_s if decode_s else None,
                "turn_ms": wall_ms,
                "output_ids": list(report.output_ids),
            }
        )
        replies.append(reply)
        text = reply if history is None else history[turn]
        messages.append({"role": "assistant", "content": text})
        manager.wait_settled()  # the user's reading time; and nothing runs beside plain_ttft
    last_prompt = render_prompt(tokenizer, messages[:-1])
    first_prompt = render_prompt(tokenizer, messages[:2])
    return {
        "variant": variant,
        "weight_bytes": weight_bytes(model),
        "plain_ttft_first_ms": plain_ttft(model, first_prompt, args.max_new_tokens),
        "plain_ttft_last_ms": plain_ttft(model, last_prompt, args.max_new_tokens),
        "rows": rows,
        "replies": replies,
    }


def format_table(results: list[dict]) -> str:
    base = results[0]
    lines = [
        f"{'variant':<16} {'weights MiB':>11} {'decode tok/s':>12} {'TTFT turn 1':>11} "
        f"{'TTFT turns 2+':>13} {'plain last':>10} {'same as f32':>11}"
    ]
    for r in results:
        later = [row["ttft_ms"] for row in r["rows"][1:]]
        same = sum(
            a["output_ids"] == b["output_ids"] for a, b in zip(r["rows"], base["rows"], strict=True)
        )
        lines.append(
            f"{r['variant']:<16} {r['weight_bytes'] / 2**20:>11.0f} "
            f"{statistics.median(row['decode_tok_s'] for row in r['rows']):>12.1f} "
            f"{r['rows'][0]['ttft_ms']:>9.0f}ms {statistics.median(later):>11.0f}ms "
            f"{r['plain_ttft_last_ms']:>8.0f}ms {same:>6}/{len(r['rows'])}"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [run_variant("float32", None, args)]
    history = results[0]["replies"]
    results += [run_variant(v, history, args) for v in VARIANTS[1:]]
    print(format_table(results))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "cpu-dtypes-smollm2-135m.json"
    out.write_text(json.dumps({"machine": describe(), "variants": results}, indent=1))
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
