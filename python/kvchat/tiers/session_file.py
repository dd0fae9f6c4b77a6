"""Session files: one session's cache, token ids and messages in ``safetensors``.

A file is self-describing and checked whole before anything uses it: its format
version; the fingerprint of the model that wrote it (config, dtype, layer
classes and every weight, see ``fingerprint``); a SHA-256 over everything else
it holds (every metadata entry, and each tensor's name, dtype, shape and
bytes); and every layer state against the layout the model itself fills
(``ModelLayout.templates``). So a truncated, corrupted or foreign file raises
``SessionFileError`` and is never half-loaded, and a file never changes
anything beyond the session it is loaded into.
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

from .. import _C
from ..bridge.layout import ATTENTION, RECURRENT, ModelLayout, describe

# 2: the checksum covers the metadata and tensor headers, not only tensor bytes.
# 3: each layer state is stored as its own description (LayerState.meta).
FORMAT = "kvchat-session-3"


class SessionFileError(ValueError):
    """A session file that cannot be used: unreadable, corrupted, or from another model."""


@dataclass
class SessionFile:
    """What a session file holds."""

    session_id: str
    messages: list[dict[str, str]]
    state: _C.CachedState | None  # None: the session had nothing cached


# ----------------------------------------------------------------- encoding
def _encode(state, name: str, tensors: dict) -> dict | None:
    """The state's own description (``state.meta``); its tensors go into
    ``tensors`` as ``name.0``, ``name.1``, ... in the state's order."""
    if state is None:
        return None
    for j, tensor in enumerate(state.tensors()):
        tensors[f"{name}.{j}"] = tensor
    return state.meta


def _check_kv(keys, values, template, where: str) -> None:
    expected = (1, template.kv_heads, keys.shape[2] if keys.dim() == 4 else -1)
    if (
        keys.dim() != 4
        or values.dim() != 4
        or tuple(keys.shape[:3]) != expected
        or tuple(values.shape[:3]) != expected
        or keys.shape[3] != template.key_dim
        or values.shape[3] != template.value_dim
        or keys.dtype != template.dtype
        or values.dtype != template.dtype
    ):
        raise ValueError(
            f"{where}: keys {tuple(keys.shape)} {keys.dtype} and values {tuple(values.shape)} "
            f"{values.dtype} do not fit this model's [1, {template.kv_heads}, tokens, "
            f"{template.key_dim}/{template.value_dim}] {template.dtype}"
        )
    if template.window is not None and keys.shape[2] > template.window:
        raise ValueError(f"{where}: {keys.shape[2]} tokens in a window of {template.window}")


def _check_part(part: str, tensors: list, template, where: str) -> None:
    """One part's tensors against the model's layout for it."""
    if part == RECURRENT:
        if len(tensors) != len(template.recurrent):
            raise ValueError(
                f"{where}: {len(tensors)} recurrent tensors, this model has "
                f"{len(template.recurrent)}"
            )
        for j, (tensor, (shape, dtype)) in enumerate(zip(tensors, template.recurrent, strict=True)):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{where}.{j}: {tuple(tensor.shape)} {tensor.dtype}, this model's is {shape} "
                    f"{dtype}"
                )
    else:
        if len(tensors) != 2:
            raise ValueError(f"{where}: an attention part needs keys and values")
        _check_kv(*tensors, template, where)


def _decode(meta, name: str, tensors: dict, template, snapshot: bool = False):
    """The layer state ``meta`` describes, checked against the model's ``template``
    for that layer. ``snapshot``: a checkpoint's, where a part that crops is absent."""
    parts = template.parts
    if meta is None:
        # Only a checkpoint may omit a layer, and only one that crops back.
        if snapshot and parts == (ATTENTION,):
            return None
        raise ValueError(f"{name}: a {describe(parts)} layer has no state")
    if not isinstance(meta, dict):
        raise ValueError(f"{name}: a state description must be a dict, got {meta!r}")
    # The parts the state must have, in tensor order. A hybrid checkpoint
    # keeps only what cannot crop, so its full-attention part is absent; but
    # a shared prefix adopted as a checkpoint holds every part.
    names = list(parts)
    descs = meta.get("parts") or []
    if len(parts) > 1 and snapshot and parts[0] == ATTENTION and len(descs) < len(parts):
        names = names[1:]
    if len(parts) > 1:
        expected = ("hybrid", [p.name for p in names])
        got = (meta.get("kind"), [d.get("kind") if isinstance(d, dict) else d for d in descs])
    else:
        expected, got = (parts[0].name, []), (meta.get("kind"), descs)
        descs = [meta]
    if got != expected:
        raise ValueError(f"{name}: a {got[0]!r} state {got[1]} for a {describe(parts)} layer")
    count = meta.get("tensors")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{name}: tensor count {count!r} is not a count")
    states = [tensors[f"{name}.{j}"] for j in range(count)]
    for j, tensor in enumerate(states):
        # A cache with NaN or infinity in it would poison every turn that reuses it.
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name}.{j}: holds values that are not finite (NaN or infinity)")
    offset = 0
    for part, desc in zip(names, descs, strict=True):
        used = desc.get("tensors")
        if isinstance(used, bool) or not isinstance(used, int) or used < 0:
            raise ValueError(f"{name}: tensor count {used!r} is not a count")
        _check_part(part, states[offset : offset + used], template, name)
        offset += used
    return _C.LayerState.from_state(meta, states)


def _digest(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every metadata entry but the digest itself, and each tensor's
    name, dtype, shape and bytes: no byte of the file's meaning is outside it."""
    h = hashlib.sha256()
    for key in sorted(metadata):
        if key != "sha256":
            h.update(json.dumps([key, metadata[key]]).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        h.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        h.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
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


def encode_state(state, slots) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """(layout, tensors) for a session's cache: the layout names each state's
    tensors, which are the session's own (views, not copies). None: no cache."""
    tensors: dict[str, torch.Tensor] = {}
    if state is None or not state.ids:
        return None, tensors
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
    return layout, tensors


def write_session(path, session_id, messages, state, fingerprint, slots) -> None:
    """Writes the file atomically: a reader sees the old file or the new one."""
    layout, tensors = encode_state(state, slots)
    tensors = _owned_cpu(tensors)
    metadata = {
        "format": FORMAT,
        "session_id": session_id,
        "messages": json.dumps(messages),
        "cache": json.dumps(layout),
        "fingerprint": json.dumps(fingerprint, sort_keys=True),
    }
    metadata["sha256"] = _digest(metadata, tensors)
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


def read_session(path, fingerprint: dict, device, model_layout: ModelLayout) -> SessionFile:
    """Reads and checks the whole file against the model (its ``fingerprint`` and
    its layout's layer templates); raises SessionFileError, changing nothing."""
    try:
        return _read_session(path, fingerprint, device, model_layout)
    except SessionFileError:
        raise
    except Exception as error:  # any malformed content is the file's fault
        raise SessionFileError(
            f"path {str(path)!r} is malformed: {type(error).__name__}: {error}"
        ) from error


def to_device(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """CPU tensors on ``device``: through pinned memory and non-blocking copies
    on CUDA, so a load costs one sync at its end rather than one per tensor."""
    device = torch.device(device)
    if device.type != "cuda":
        return {name: t.to(device) for name, t in tensors.items()}
    out = {
        name: t if t.device == device else t.pin_memory().to(device, non_blocking=True)
        for name, t in tensors.items()
    }
    torch.cuda.current_stream(device).synchronize()  # the pinned buffers may go after this
    return out


def decode_state(layout: dict, tensors: dict[str, torch.Tensor], model_layout: ModelLayout, device):
    """The ``CachedState`` an ``encode_state`` layout and its (CPU) tensors
    describe, every state checked against the model's layer templates; raises
    ValueError naming what does not fit."""
    templates, slots = model_layout.templates, model_layout.slots
    ids, trusted = layout["ids"], layout["trusted_tokens"]
    # At C speed: a Redis reload runs this at the turn's start, over every token.
    if not isinstance(ids, list) or set(map(type, ids)) - {int} or (ids and min(ids) < 0):
        raise ValueError("its token ids are not a list of non-negative ints")
    if not _count(trusted) or trusted > len(ids):
        raise ValueError(f"trusted_tokens {trusted!r} is not a count of its {len(ids)} tokens")
    if layout["slots"] != slots:
        raise ValueError(
            f"it records recurrent tensors {layout['slots']}, this model fills {slots}"
        )
    if len(layout["layers"]) != len(templates):
        raise ValueError(f"it has {len(layout['layers'])} layers, the model {len(templates)}")
    tensors = to_device(tensors, device)
    layers = [
        _decode(d, f"layer.{i}", tensors, templates[i]) for i, d in enumerate(layout["layers"])
    ]
    checkpoints = []
    for c, cp in enumerate(layout["checkpoints"]):
        if not _count(cp["position"]):
            raise ValueError(f"checkpoint {c}'s position {cp['position']!r} is not a count")
        if len(cp["states"]) != len(templates):
            raise ValueError(f"checkpoint {c} has the wrong layers")
        states = [
            _decode(d, f"checkpoint.{c}.{i}", tensors, templates[i], snapshot=True)
            for i, d in enumerate(cp["states"])
        ]
        checkpoints.append(_C.Checkpoint(cp["position"], states))
    text = layout["text"]
    if not isinstance(text, str):
        raise ValueError("its cached text is not a string")
    return _C.CachedState(ids, layers, checkpoints, text, trusted)


def _count(value) -> bool:
    """A JSON count: an int >= 0, and not a bool (JSON true is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_session(path, fingerprint: dict, device, model_layout: ModelLayout) -> SessionFile:
    metadata = read_metadata(path)
    saved = json.loads(metadata["fingerprint"])
    if not isinstance(saved, dict) or saved != fingerprint:
        saved = saved if isinstance(saved, dict) else {}
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
    if _digest(metadata, tensors) != metadata.get("sha256"):
        raise SessionFileError(f"path {str(path)!r} is corrupted: its checksum does not match")
    messages = json.loads(metadata["messages"])
    layout = json.loads(metadata["cache"])
    state = None
    if layout is not None:
        try:
            state = decode_state(layout, tensors, model_layout, device)
        except ValueError as error:
            raise SessionFileError(f"path {str(path)!r}: {error}") from error
    session_id = metadata["session_id"]
    if not isinstance(messages, list):
        raise SessionFileError(f"path {str(path)!r} has malformed messages")
    from ..arguments import check_session_id  # arguments imports the tiers

    try:
        check_session_id(session_id)
    except (TypeError, ValueError) as error:
        raise SessionFileError(f"path {str(path)!r} has no usable session id: {error}") from None
    return SessionFile(session_id, messages, state)
