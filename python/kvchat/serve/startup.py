"""What ``kvchat serve`` says once the model is loaded: the model id clients
send, the address, dtype, device and the options that change what a client
sees. One line, logged at INFO (shown by default)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .preflight import is_tiny

if TYPE_CHECKING:  # hints only: the manager and the app need not load for model_id
    from ..manager import SessionManager
    from .app import ServeConfig


def model_id(spec: str) -> str:
    """The id a model is served under when ``--served-model-name`` is not
    given: a file's name without ``.gguf``, a folder's name, ``tiny[:FAMILY]``
    as given (never a path, which clients would have to spell)."""
    if is_tiny(spec):
        return spec
    path = Path(spec).resolve()
    return path.stem if path.is_file() and path.suffix == ".gguf" else path.name


def base_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def startup_line(args: argparse.Namespace, manager: SessionManager, config: ServeConfig) -> str:
    model = manager.model
    tier = manager.tier
    store = getattr(tier, "url", None) or (args.spill_dir and f"spill {args.spill_dir}") or "none"
    budget = args.max_cache_bytes or "no limit"
    keys = f"{len(config.api_keys)} API key(s)" if config.api_keys else "no API key"
    return (
        f"serving model {config.model_name!r} at {base_url(args.host, args.port)} "
        f"({str(model.dtype).removeprefix('torch.')} on {model.device}): "
        f"max sessions {args.max_sessions}, cache bytes {budget}, store {store}, "
        f"settle {'off' if args.no_settle else f'after {args.settle_delay:g} s'}, "
        f"compile {'on' if args.compile else 'off'}, "
        f"{keys}"
    )
