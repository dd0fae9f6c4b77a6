"""Decode tokens/s: kvchat's in-place KV buffer vs transformers' DynamicCache.

    python benchmarks/decode.py --model smollm2-135m --contexts 1024 4096 8192

DynamicLayer.update concatenates the whole layer on every token, so its decode
step copies O(context); kvchat's BufferedLayer appends one token in place.
Both run the same greedy generate from the same prefilled context.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from kvchat.cache_bridge import CacheBridge
from kvchat.timing import FirstTokenTimer
from transformers import DynamicCache
from workload import PRESETS, TINY, load_model


def decode_rate(model, ids, cache, new_tokens: int) -> tuple[float, tuple[int, ...]]:
    """Tokens/s after the first token, and the generated ids."""
    timer = FirstTokenTimer()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    out = model.generate(ids, past_key_values=cache, **timer.attach(kwargs))
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - timer.first_at
    return (new_tokens - 1) / decode_s, tuple(out[0, ids.shape[1] :].tolist())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help=f"{TINY!r} or {sorted(PRESETS)}")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of N per cache kind")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument(
        "--profile", action="store_true", help="print where decode time goes, per cache kind"
    )
    args = parser.parse_args(argv)

    model, _ = load_model(args.model, getattr(torch, args.dtype), args.device)
    bridge = CacheBridge(model)
    generator = torch.Generator().manual_seed(0)
    results = []
    for context in args.contexts:
        ids = torch.randint(3, 600, (1, context + 1), generator=generator).to(args.device)
        prefilled = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :context], past_key_values=prefilled)
        states = bridge.from_cache(prefilled, context)
        rates = {"DynamicCache": [], "kvchat": []}
        outputs = {}
        for _ in range(args.repeats):
            for kind in rates:
                if kind == "DynamicCache":
                    cache = copy.deepcopy(prefilled)
                else:
                    cache = bridge.to_cache(states, reserve=context + 1 + args.new_tokens)
                rate, outputs[kind] = decode_rate(model, ids, cache, args.new_tokens)
                rates[kind].append(rate)
        row = dict(
            context=context,
            dynamic_cache_tps=max(rates["DynamicCache"]),
            kvchat_tps=max(rates["kvchat"]),
            same_tokens=outputs["kvchat"] == outputs["DynamicCache"],
        )
        row["speedup"] = row["kvchat_tps"] / row["dynamic_cache_tps"]
        if args.profile:
            for kind in rates:
                fresh = (
                    copy.deepcopy(prefilled)
                    if kind == "DynamicCache"
                    else bridge.to_cache(states, reserve=context + 1 + args.new_tokens)
                )
                with torch.profiler.profile() as prof:
                    decode_rate(model, ids, fresh, args.new_tokens)
                print(f"--- {kind}, context {context}: top ops by self CPU time")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        results.append(row)
        print(
            f"context {context:>6}: DynamicCache {row['dynamic_cache_tps']:7.1f} tok/s, "
            f"kvchat {row['kvchat_tps']:7.1f} tok/s ({row['speedup']:.2f}x), "
            f"same tokens: {'yes' if row['same_tokens'] else 'NO'}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-{args.model}-{args.device}.json"
    config = {k: str(v) for k, v in vars(args).items()}
    path.write_text(json.dumps(dict(config=config, results=results), indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
