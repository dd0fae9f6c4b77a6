"""What ``kvchat serve`` checks before it loads the model (5 to 25 s for a
real one): the model path, the address it will listen on and the device, so a
typo fails at once with a message naming the flag, not after the load with a
traceback (an ``OverflowError`` from ``bind``, an ``AssertionError`` from torch,
uvicorn's "address already in use")."""

from __future__ import annotations

import argparse
import errno
import os
import reprlib
import socket
from pathlib import Path

import torch

from ..pretrained import check_checkpoint
from ..tiny import FAMILIES
from ..units import parse_bytes

_MAX_TTL = 10 * 365 * 24 * 3600.0  # seconds


def preflight(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag (or MODEL) and its value, saying what to do."""
    check_model_spec(args.model)
    # NaN fails this too; Redis takes a life in whole milliseconds below 2**63.
    if not 0 <= args.session_ttl <= _MAX_TTL:
        raise ValueError(
            f"--session-ttl must be 0 (never) to {_MAX_TTL:.0f} seconds (ten years), got "
            f"{args.session_ttl}"
        )
    if args.store is not None and args.spill_dir is not None:
        raise ValueError("give --store or --spill-dir, not both")
    if getattr(args, "warm_up", None) and not args.compile:
        raise ValueError("--warm-up compiles the decode: give --compile too")
    if args.max_sessions < 1:
        raise ValueError(f"--max-sessions must be at least 1, got {args.max_sessions}")
    parse_bytes(args.max_cache_bytes, "--max-cache-bytes")  # names the flag and the value
    for key in args.api_key or ():
        check_api_key(key, "--api-key")
    for key in os.environ.get("KVCHAT_API_KEYS", "").split(","):
        if key.strip():
            check_api_key(key.strip(), "KVCHAT_API_KEYS")
    check_address(args.host, args.port)
    check_device(args.device)


def check_api_key(key: str, where: str) -> None:
    """A client sends its key in the Authorization header, which carries
    printable ASCII: a key with anything else was accepted, and no client
    could ever log in with it."""
    if not key or not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(
            f"{where} {reprlib.repr(key)}: a key is sent in an HTTP header, so it must be "
            "printable ASCII with no spaces"
        )


def is_tiny(spec: str) -> bool:
    return spec == "tiny" or spec.startswith("tiny:")


def check_model_spec(spec: str) -> None:
    if is_tiny(spec):
        family = spec.partition(":")[2] or "llama"
        if family not in FAMILIES:
            raise ValueError(f"unknown tiny family {family!r} in MODEL {spec!r}; one of {FAMILIES}")
        return
    try:
        check_checkpoint(Path(spec))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"MODEL: {error}; give a checkpoint folder, a .gguf file or tiny[:FAMILY]"
        ) from None


def check_address(host: str, port: int) -> None:
    """The port is in range and ``host:port`` can be listened on now."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be 1 to 65535, got {port}")
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r} is not an address of this machine: {error}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As uvicorn binds (asyncio's create_server): a port in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise ValueError(
                        f"--port {port}: the address {shown} is already in use (another "
                        "kvchat serve?); stop that server or choose another --port"
                    ) from None
                raise ValueError(
                    f"--host {host!r} --port {port}: cannot listen on {shown}: {error.strerror}"
                ) from None


def check_device(spec: str) -> None:
    """``spec`` names a device this torch has."""
    try:
        device = torch.device(spec)
    except RuntimeError as error:
        raise ValueError(f"--device {spec!r} is not a torch device: {error}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU"
            raise ValueError(
                f"--device {spec!r}: {why} (torch {torch.__version__}); use --device cpu, "
                "or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {spec!r}: this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}"
            )
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as error:
            raise ValueError(f"--device {spec!r} cannot be used here: {error}") from None
