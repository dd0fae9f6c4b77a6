"""What a benchmark ran on, recorded beside its figures: CPU timings depend
on the CPU's model and instruction sets (bfloat16 matrix units above all)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
import transformers

_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def describe() -> dict:
    """The CPU (model, cores, the instruction sets that matter here), the GPU
    if any, and the versions of Python, torch and transformers."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "cpu_flags": [f for f in _FLAGS if f in flags],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
