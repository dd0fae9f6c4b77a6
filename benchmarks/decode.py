"""Decode tokens/s: kvchat's in-place KV buffer vs transformers' DynamicCache
and StaticCache.

    python benchmarks/decode.py --model smollm2-135m --contexts 1024 4096 8192
    python benchmarks/decode.py --device cuda --dtype bfloat16 --contexts 1024 4096 8192 32768 \
        --caches DynamicCache kvchat StaticCache StaticCache+compile kvchat+compile
    python benchmarks/decode.py --contexts 1024 4096 \
        --caches DynamicCache kvchat StaticCache+compile kvchat+compile

DynamicLayer.update concatenates the whole layer on every token, so its decode
step copies O(context); kvchat's BufferedLayer appends one token in place.
StaticCache also writes in place, into tensors of a fixed size, which is what
lets transformers compile its decode step (``torch.compile`` with CUDA graphs,
as ``generate`` does on its own for a StaticCache on a GPU):
``StaticCache+compile`` is that, ``StaticCache`` the same cache eager
(``disable_compile=True``). ``kvchat+compile`` is kvchat's compiled turn:
the session's states copied into a pooled ``StaticCache`` of a bucketed
capacity (``kvchat.bridge.static_cache``); like every kind here, timed from
the first token, so that copy (part of a turn's time to first token) is not.
Both compiled kinds compile on the CPU too here (``_compile_all_devices``), as
kvchat does with ``compile=True``. All run the same greedy generate from the
same prefilled context; the first of the repeats includes compiling.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from kvchat.bridge import CacheBridge
from kvchat.compiled import CompiledDecode, compile_everywhere
from kvchat.timing import FirstTokenTimer
from transformers import DynamicCache, StaticCache
from workload import PRESETS, TINY, load_model

CACHES = ("DynamicCache", "kvchat", "StaticCache", "StaticCache+compile", "kvchat+compile")


def fresh(kind: str, prefilled, states, static, bridge, reserve: int):
    """The prefilled context in a cache of this kind, and generate's extra arguments."""
    if kind == "DynamicCache":
        return copy.deepcopy(prefilled), {}
    if kind == "kvchat":
        return bridge.to_cache(list(states), reserve=reserve), {}  # to_cache consumes its list
    if kind == "kvchat+compile":
        cache = bridge.to_static_cache(states, CompiledDecode.capacity(reserve, None))
        return cache, {"compile_config": compile_everywhere()}
    if kind == "StaticCache":
        return copy.deepcopy(static), {"disable_compile": True}
    return copy.deepcopy(static), {"compile_config": compile_everywhere()}


def decode_rate(model, ids, cache, new_tokens: int, **extra) -> tuple[float, tuple[int, ...]]:
    """Tokens/s after the first token, and the generated ids."""
    timer = FirstTokenTimer()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)
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
    parser.add_argument(
        "--caches",
        nargs="+",
        choices=CACHES,
        default=list(CACHES[:2]),
        help="the +compile kinds compile on every device (on the CPU too)",
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
        static = None
        if any(kind.startswith("StaticCache") for kind in args.caches):
            static = StaticCache(config=model.config, max_cache_len=context + 1 + args.new_tokens)
            with torch.no_grad():
                model(ids[:, :context], past_key_values=static)

        prepared = dict(
            prefilled=prefilled,
            states=states,
            static=static,
            bridge=bridge,
            reserve=context + 1 + args.new_tokens,
        )
        rates = {kind: [] for kind in args.caches}
        outputs = {}
        for _ in range(args.repeats):
            for kind in rates:
                cache, extra = fresh(kind, **prepared)
                rate, outputs[kind] = decode_rate(model, ids, cache, args.new_tokens, **extra)
                rates[kind].append(rate)
                if kind == "kvchat+compile":
                    bridge.give_back(cache)  # as a turn does: the next one reuses it
        row = dict(context=context, tokens_per_s={k: max(v) for k, v in rates.items()})
        row["same_tokens"] = {k: outputs[k] == outputs[args.caches[0]] for k in rates}
        if {"DynamicCache", "kvchat"} <= set(rates):
            row["dynamic_cache_tps"] = row["tokens_per_s"]["DynamicCache"]
            row["kvchat_tps"] = row["tokens_per_s"]["kvchat"]
            row["speedup"] = row["kvchat_tps"] / row["dynamic_cache_tps"]
        if args.profile:
            for kind in rates:
                cache, extra = fresh(kind, **prepared)
                with torch.profiler.profile() as prof:
                    decode_rate(model, ids, cache, args.new_tokens, **extra)
                print(f"--- {kind}, context {context}: top ops by self CPU time")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        results.append(row)
        cells = ", ".join(
            f"{kind} {rate:7.1f}{'' if row['same_tokens'][kind] else ' (other tokens)'}"
            for kind, rate in row["tokens_per_s"].items()
        )
        print(f"context {context:>6} tok/s: {cells}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-{args.model}-{args.device}.json"
    config = {k: str(v) for k, v in vars(args).items()}
    path.write_text(json.dumps(dict(config=config, results=results), indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
