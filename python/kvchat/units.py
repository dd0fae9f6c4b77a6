"""Byte sizes given as ints or human strings such as "2GiB" or "512 MB"."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str | None, name: str = "max_cache_bytes") -> int | None:
    """Returns a byte count, or None for no limit; raises ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be an int, a string such as '2GiB', or None; got {value!r}")
    if isinstance(value, int):
        count = value
    else:
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ValueError(f"{name} must look like '2GiB', '512MB' or '1000000', got {value!r}")
        count = int(float(match.group(1)) * _UNITS[unit])
    if not 0 < count < 2**63:  # the core counts bytes in signed 64 bits
        raise ValueError(f"{name} must be positive and below 2**63 bytes, got {value!r}")
    return count


def format_bytes(count: int) -> str:
    """``count`` as the largest binary unit it is a whole number of ("64MiB"),
    else in bytes: what a flag such as --response-bytes-per-key reads back."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size and count % size == 0:
            return f"{count // size}{unit}"
    return f"{count} bytes"
