"""What building a SessionManager pays for the model fingerprint: one pass over
every parameter and buffer, on the model's device.

    python benchmarks/fingerprint.py --model smollm2-135m --dtype float32 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kvchat.fingerprint import weights_checksum
from workload import PRESETS, TINY, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help=f"{TINY!r} or {sorted(PRESETS)}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, _ = load_model(args.model, getattr(torch, args.dtype), args.device)
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    weights_checksum(model)  # warm-up
    times = []
    for _ in range(args.repeats):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        weights_checksum(model)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    print(
        f"{args.model} {args.dtype} on {args.device}: {nbytes / 2**20:.0f} MiB of weights, "
        f"fingerprint median {median * 1e3:.0f} ms over {args.repeats} runs "
        f"({nbytes / median / 2**30:.2f} GiB/s)"
    )


if __name__ == "__main__":
    main()
