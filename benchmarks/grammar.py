"""llguidance against xgrammar on this CPU: the cost of grammar-constrained decoding.

For each library installed: the time to wrap a real vocabulary (llama.cpp's
``ggml-vocab-*.gguf``, loaded by transformers), to compile a tool-call JSON
schema, and to compute the next-token mask per token while a walk through the
grammar (a seeded random allowed token each step, as a model would pick one)
writes a reply. The mask is what a constrained turn adds to each decode step.

    python benchmarks/grammar.py --vocab llama-bpe --tokens 200

Writes ``benchmarks/results/grammar-<vocab>.json``. xgrammar is not a kvchat
dependency: install it to compare (``pip install --no-deps xgrammar
apache-tvm-ffi``, after torch).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "search_flights"},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "maxLength": 40},
                "destination": {"type": "string", "maxLength": 40},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "cabin": {"enum": ["economy", "premium", "business", "first"]},
                "flexible": {"type": "boolean"},
                "stops": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            },
            "required": ["origin", "destination", "passengers", "cabin", "flexible", "stops"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def _walk(first_mask, consume, vocab: int, tokens: int, seed: int) -> list[float]:
    """Seconds per mask over a seeded random walk of up to ``tokens`` steps."""
    rng = random.Random(seed)
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        allowed = first_mask()
        times.append(time.perf_counter() - start)
        choices = np.flatnonzero(allowed[:vocab])
        if choices.size == 0:
            break
        token = int(choices[rng.randrange(choices.size)])
        if not consume(token):
            break
    return times


def bench_llguidance(tokenizer, vocab: int, tokens: int, seed: int) -> dict:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    wrap = time.perf_counter() - start
    start = time.perf_counter()
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(schema))
    assert not matcher.is_error(), matcher.get_error()
    compile_s = time.perf_counter() - start

    def mask():
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little").astype(bool)

    def consume(token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_stopped()

    times = _walk(mask, consume, vocab, tokens, seed)
    return _summary(llguidance.__name__, wrap, compile_s, times)


def bench_xgrammar(tokenizer, vocab: int, tokens: int, seed: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    wrap = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def mask():
        matcher.fill_next_token_bitmask(bitmask)
        bits = bitmask[0].numpy().view(np.uint8)
        return np.unpackbits(bits, bitorder="little").astype(bool)

    def consume(token: int) -> bool:
        return matcher.accept_token(token) and not matcher.is_terminated()

    times = _walk(mask, consume, vocab, tokens, seed)
    return _summary("xgrammar", wrap, compile_s, times)


def _summary(name: str, wrap: float, compile_s: float, times: list[float]) -> dict:
    return {
        "library": name,
        "wrap_tokenizer_s": round(wrap, 3),
        "compile_ms": round(compile_s * 1e3, 2),
        "tokens": len(times),
        "mask_us_median": round(statistics.median(times) * 1e6, 1),
        "mask_us_mean": round(statistics.fmean(times) * 1e6, 1),
        "mask_us_max": round(max(times) * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="llama-bpe", help="llama.cpp's ggml-vocab-NAME.gguf")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from llama_cpp_models import fetch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fetch(), gguf_file=f"ggml-vocab-{args.vocab}.gguf")
    vocab = len(tokenizer)
    results = []
    for bench in (bench_llguidance, bench_xgrammar):
        try:
            runs = [bench(tokenizer, vocab, args.tokens, seed) for seed in range(args.seeds)]
        except ImportError as error:
            print(f"skipped {bench.__name__}: {error}")
            continue
        best = dict(runs[-1])
        for key in ("mask_us_median", "mask_us_mean", "mask_us_max", "compile_ms"):
            best[key] = round(statistics.median(r[key] for r in runs), 2)
        best["wrap_tokenizer_s"] = runs[0]["wrap_tokenizer_s"]
        best["tokens"] = sum(r["tokens"] for r in runs)
        results.append(best)
        print(json.dumps(best))
    out = args.out or Path(__file__).parent / "results" / f"grammar-{args.vocab}.json"
    summary = {"vocab": args.vocab, "vocab_size": vocab, "results": results}
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
