"""What keeping grouped keys grouped under a mask saves (kvchat/engine/grouped_keys.py):
prefill forwards over a cache, on the real SmolLM2 (9 query heads, 3 key/value
heads) in float32 with the engine's packed weights, with transformers'
``repeat_kv`` (off) and with SDPA's ``enable_gqa`` (on), alternating.

Cases: one prompt over a past (a turn over its cache, as the engine's chunk
runs it) and several prompts over pasts of their own side by side
(``prompts.prefill_together``, a server's turns arriving together).

    python benchmarks/grouped_keys.py
    python benchmarks/grouped_keys.py --past 400 --new 70 --rows 1 3 4 8 --repetitions 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from kvchat.bridge import CacheBridge
from kvchat.engine import grouped_keys, packed
from kvchat.engine.prompts import prefill_together
from kvchat.pretrained import load_pretrained, smollm2_path
from machine import describe


class _Row:
    """What prefill_together reads of a row: its ids and a cache holding ``past``."""

    def __init__(self, model, bridge, past: int, new: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(100, 1000, (1, past + new), generator=generator)
        self.prompt_ids, self.prompt_tokens, self.prefilled = self.ids[0], past + new, past
        self.cache = bridge.new_cache()
        if past:
            kwargs = {bridge.cache_argument: self.cache}
            model(input_ids=self.ids[:, :past], use_cache=True, logits_to_keep=1, **kwargs)


def _timed(model, bridge, rows: int, past: int, new: int) -> float:
    """ms of one forward over ``rows`` prompts of ``new`` tokens over ``past``."""
    group = [_Row(model, bridge, past, new, seed) for seed in range(rows)]
    started = time.perf_counter()
    if rows == 1:  # as the engine's chunk: the row's own cache, one forward
        row = group[0]
        kwargs = {bridge.cache_argument: row.cache}
        model(input_ids=row.ids[:, past:], use_cache=True, logits_to_keep=1, **kwargs)
    else:
        prefill_together(model, group, bridge.new_cache, bridge.cache_argument, "tensor")
    return (time.perf_counter() - started) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--past", type=int, nargs="+", default=[100, 400])
    parser.add_argument("--new", type=int, default=70)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 4, 8])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_pretrained(smollm2_path())
    bridge = CacheBridge(model)
    weights = packed.PackedWeights(model, "auto")
    packed.on_this_thread(weights.why_not is None)
    if not grouped_keys.install():
        raise SystemExit("this transformers has no use_gqa_in_sdpa: nothing to compare")
    results = []
    with torch.inference_mode():
        for past in args.past:
            for rows in args.rows:
                times = {"off": [], "on": []}
                for repetition in range(args.repetitions):
                    order = ("off", "on") if repetition % 2 == 0 else ("on", "off")
                    for mode in order:
                        grouped_keys.on_this_thread(mode == "on")
                        times[mode].append(_timed(model, bridge, rows, past, args.new))
                grouped_keys.on_this_thread(False)
                off, on = statistics.median(times["off"]), statistics.median(times["on"])
                results.append(
                    {"past": past, "new": args.new, "rows": rows, "off_ms": off, "on_ms": on}
                )
                print(
                    f"past {past:4}  {rows} x {args.new} new  repeat_kv {off:7.1f} ms  "
                    f"enable_gqa {on:7.1f} ms  ({on / off:.2f}x)",
                    flush=True,
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "grouped-keys-smollm2-cpu.json"
    path.write_text(
        json.dumps({"machine": describe(), "settings": vars(args), "results": results}, indent=2)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
