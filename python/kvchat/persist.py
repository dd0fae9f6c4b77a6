"""Session files: one session's cache, token ids and messages in ``safetensors``.

A file is self-describing and checked whole before anything uses it: its format
version, the fingerprint of the model that wrote it (config, dtype, layer
classes and a sample of the weights) and a SHA-256 of every tensor byte. So a
truncated or corrupted file, or one from another model, raises
``SessionFileError`` and is never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from . import _C

FORMAT = "kvchat-session-1"
# Config entries that differ between two loads of one model, or do not affect its KV.
_VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash")


class SessionFileError(ValueError):
    """A session file that cannot be used: unreadable, corrupted, or from another model."""


@dataclass
class SessionFile:
    """What a session file holds."""

    session_id: str
    messages: list[dict[str, str]]
    state: _C.CachedState | None  # None: the session had nothing cached
    # Per layer, the (kind, index) of each recurrent tensor, as CacheBridge learned them.
    slots: list | None = None


def model_fingerprint(model, layer_classes: list[str]) -> dict:
    """What must match for a saved cache to be valid for ``model``."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG}
    config_json = json.dumps(config, sort_keys=True, default=str)
    weights = hashlib.sha256()
    params = list(model.parameters())
    for param in (params[0], params[-1]):  # enough to tell two seeds or checkpoints apart
        sample = param.detach().reshape(-1)[:4096].to("cpu", torch.float64).contiguous()
        weights.update(sample.numpy().tobytes())
    return {
        "model_type": model.config.model_type,
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
        "dtype": str(next(model.parameters()).dtype),
        "layer_classes": layer_classes,
        "weights_sha256": weights.hexdigest(),
    }


# ----------------------------------------------------------------- encoding
def _encode(state, name: str, tensors: dict) -> dict | None:
    """A JSON description of ``state``; its tensors go into ``tensors`` under ``name``."""
    if state is None:
        return None
    if isinstance(state, _C.HybridState):
        return {
            "kind": "hybrid",
            "attention": _encode(state.attention, f"{name}.a", tensors),
            "recurrent": _encode(state.recurrent, f"{name}.r", tensors),
        }
    parts = state.tensors()
    for j, tensor in enumerate(parts):
        tensors[f"{name}.{j}"] = tensor
    if isinstance(state, _C.AttentionState):
        return {"kind": "attention"}
    if isinstance(state, _C.SlidingWindowState):
        return {"kind": "sliding_window", "tokens": state.num_tokens}
    if isinstance(state, _C.RecurrentState):
        return {"kind": "recurrent", "tokens": state.num_tokens, "count": len(parts)}
    raise TypeError(f"cannot save a layer state of type {type(state).__name__}")


def _decode(desc: dict | None, name: str, tensors: dict):
    if desc is None:
        return None
    kind = desc["kind"]
    if kind == "hybrid":
        return _C.HybridState(
            _decode(desc["attention"], f"{name}.a", tensors),
            _decode(desc["recurrent"], f"{name}.r", tensors),
        )
    if kind == "attention":
        return _C.AttentionState(tensors[f"{name}.0"], tensors[f"{name}.1"])
    if kind == "sliding_window":
        return _C.SlidingWindowState(tensors[f"{name}.0"], tensors[f"{name}.1"], desc["tokens"])
    if kind == "recurrent":
        parts = [tensors[f"{name}.{j}"] for j in range(desc["count"])]
        return _C.RecurrentState(parts, desc["tokens"])
    raise SessionFileError(f"unknown layer kind {kind!r}")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _owned_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that share no storage (safetensors refuses aliases)."""
    out, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def write_session(path, session_id, messages, state, fingerprint, slots=None) -> None:
    """Writes the file atomically: a reader sees the old file or the new one."""
    tensors: dict[str, torch.Tensor] = {}
    layout = None
    if state is not None and state.ids:
        layout = {
            "ids": list(state.ids),
            "text": state.text,
            "trusted_tokens": state.trusted_tokens,
            "slots": slots,
            "layers": [_encode(s, f"layer.{i}", tensors) for i, s in enumerate(state.layers)],
            "checkpoints": [
                {
                    "position": cp.position,
                    "states": [
                        _encode(s, f"checkpoint.{c}.{i}", tensors) for i, s in enumerate(cp.states)
                    ],
                }
                for c, cp in enumerate(state.checkpoints)
            ],
        }
    tensors = _owned_cpu(tensors)
    metadata = {
        "format": FORMAT,
        "session_id": session_id,
        "messages": json.dumps(messages),
        "cache": json.dumps(layout),
        "fingerprint": json.dumps(fingerprint, sort_keys=True),
        "sha256": _digest(tensors),
    }
    path = Path(path)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_metadata(path) -> dict[str, str]:
    """The file's metadata, without reading its tensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise SessionFileError(
            f"path {str(path)!r} is not a readable session file: {error}"
        ) from error
    if metadata.get("format") != FORMAT:
        raise SessionFileError(
            f"path {str(path)!r} is not a kvchat session file (format "
            f"{metadata.get('format')!r}, expected {FORMAT!r})"
        )
    return metadata


def read_session(path, fingerprint: dict, device) -> SessionFile:
    """Reads and checks the whole file; raises SessionFileError, changing nothing."""
    metadata = read_metadata(path)
    saved = json.loads(metadata["fingerprint"])
    if saved != fingerprint:
        differ = sorted(
            k for k in set(saved) | set(fingerprint) if saved.get(k) != fingerprint.get(k)
        )
        raise SessionFileError(
            f"path {str(path)!r} was saved from a different model: {', '.join(differ)} differ "
            f"(saved {saved.get('model_type')!r} {saved.get('dtype')}, this model "
            f"{fingerprint.get('model_type')!r} {fingerprint.get('dtype')})"
        )
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise SessionFileError(f"path {str(path)!r} is truncated or corrupted: {error}") from error
    if _digest(tensors) != metadata.get("sha256"):
        raise SessionFileError(
            f"path {str(path)!r} is corrupted: its tensor checksum does not match"
        )
    try:
        messages = json.loads(metadata["messages"])
        layout = json.loads(metadata["cache"])
        tensors = {name: t.to(device) for name, t in tensors.items()}
        state, slots = None, None
        if layout is not None:
            slots = layout["slots"]
            layers = [_decode(d, f"layer.{i}", tensors) for i, d in enumerate(layout["layers"])]
            checkpoints = [
                _C.Checkpoint(
                    cp["position"],
                    [
                        _decode(d, f"checkpoint.{c}.{i}", tensors)
                        for i, d in enumerate(cp["states"])
                    ],
                )
                for c, cp in enumerate(layout["checkpoints"])
            ]
            state = _C.CachedState(
                layout["ids"], layers, checkpoints, layout["text"], layout["trusted_tokens"]
            )
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise SessionFileError(f"path {str(path)!r} has a malformed layout: {error!r}") from error
    return SessionFile(metadata["session_id"], messages, state, slots)
