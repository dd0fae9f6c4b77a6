"""What one CUDA launch costs on this machine, from Python: the floor under any
eager decode step (a 135M llama's step is a few hundred launches)."""

from __future__ import annotations

import os
import time

import torch


def main() -> None:
    print("CUDA_LAUNCH_BLOCKING =", os.environ.get("CUDA_LAUNCH_BLOCKING"))
    print("torch threads:", torch.get_num_threads(), "cpu count:", os.cpu_count())
    x = torch.ones(16, device="cuda")
    for n in (100, 1000):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(n):
            x = x + 1
        torch.cuda.synchronize()
        print(f"{n} tiny adds: {(time.perf_counter() - started) / n * 1e6:.1f} us per launch")
    a = torch.randn(576, 576, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(1000):
        a @ a
    torch.cuda.synchronize()
    print(f"1000 576x576 bf16 matmuls: {(time.perf_counter() - started) * 1e3:.1f} us each")


if __name__ == "__main__":
    main()
