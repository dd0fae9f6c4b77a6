"""The snapshot codec: a session's tensors as content-addressed chunks and a
manifest that lists them, and back. No Redis and no model here: tensors and
bytes.

A full-attention layer's keys or values ([1, heads, tokens, dim]) are cut
along the token axis into blocks of a fixed number of tokens, so the blocks of
a prefix are the same bytes turn after turn, and across sessions that share
it: a turn uploads only the blocks that are new. Other tensors are cut by
bytes. No chunk is over ``chunk_bytes``. Each chunk is named by the SHA-256 of
its bytes, and checked against it when read back.
"""

from __future__ import annotations

import base64
import json
import time
import warnings

import numpy
import torch

from ..session_file import encode_state
from .keys import digest

FORMAT = "kvchat-store-2"


class StoreMiss(Exception):
    """Why a stored snapshot was not used (a reason label and a message)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def encode_snapshot(
    layout: dict,
    tensors: dict,
    *,
    session_id: str,
    model: str,
    fingerprint: dict,
    messages: list,
    block_tokens: int,
    chunk_bytes: int,
) -> tuple[dict, dict[str, bytes]]:
    """(the manifest, its chunks by digest) of one snapshot (``layout`` and
    ``tensors`` as ``encode_state`` gives them). Runs no torch op that starts
    a thread team: it runs on the writer thread, beside the turns."""
    chunks: dict[str, bytes] = {}
    entries = {}
    attention = attention_tensors(layout)
    for name, tensor in tensors.items():
        split, pieces = cut(tensor, name in attention, block_tokens, chunk_bytes)
        digests = [digest(p) for p in pieces]
        chunks.update(zip(digests, pieces, strict=True))
        entries[name] = {
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "split": split,
            "chunks": digests,
            "bytes": [len(p) for p in pieces],
        }
    layout = dict(layout)
    ids = numpy.asarray(layout.pop("ids"), dtype="<i8")
    manifest = {
        "format": FORMAT,
        "model": model,
        "fingerprint": fingerprint,
        "session_id": session_id,
        "ids": base64.b64encode(ids.tobytes()).decode(),
        "layout": layout,
        "messages": messages,
        "tensors": entries,
        "written_at": time.time(),
    }
    return manifest, chunks


def decode_manifest(raw: bytes, fingerprint: dict, session_id: str) -> tuple[dict, torch.Tensor]:
    """(the manifest, its token ids) of ``session_id``'s snapshot as stored;
    ``StoreMiss`` for anything that is not one this model wrote of it."""
    try:
        manifest = json.loads(raw)
        fmt = manifest.get("format")
    except (ValueError, AttributeError) as error:
        raise StoreMiss("malformed", f"manifest is not a JSON object: {error}") from None
    if fmt != FORMAT:
        raise StoreMiss("format", f"format {fmt!r}, this kvchat reads {FORMAT!r}")
    if manifest.get("fingerprint") != fingerprint:
        raise StoreMiss("fingerprint", "the snapshot was written by a different model")
    if manifest.get("session_id") != session_id:
        raise StoreMiss("session", f"the snapshot is of session {manifest.get('session_id')!r}")
    try:
        ids = torch.frombuffer(bytearray(base64.b64decode(manifest["ids"])), dtype=torch.int64)
    except (KeyError, TypeError, ValueError) as error:
        raise StoreMiss("malformed", f"manifest token ids: {error}") from None
    return manifest, ids


def cut(
    tensor: torch.Tensor, by_tokens: bool, block_tokens: int, chunk_bytes: int
) -> tuple[str, list[bytes]]:
    """(how it was cut, the chunks): a 4-D keys or values tensor along its
    token axis (``by_tokens``) in blocks of ``block_tokens`` (fewer where a
    block would pass ``chunk_bytes``), any other by ``chunk_bytes``."""
    array = _bytes_view(tensor)  # numpy, so no torch op runs on this thread
    if by_tokens and tensor.dim() == 4 and tensor.shape[2] > 0:
        per_token = max(1, tensor[:, :, :1].numel() * tensor.element_size())
        block = max(1, min(block_tokens, chunk_bytes // per_token))
        return "tokens", [
            array[:, :, a : a + block].tobytes() for a in range(0, tensor.shape[2], block)
        ]
    raw = array.tobytes()
    return "bytes", [raw[a : a + chunk_bytes] for a in range(0, len(raw), chunk_bytes)] or [b""]


def _bytes_view(tensor: torch.Tensor) -> numpy.ndarray:
    """The tensor's bytes as a numpy uint8 array of the same shape (the last
    axis in bytes): a view, copied only off a GPU or where the last axis is
    strided, and then one device copy, not a CPU-parallel op."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.stride(-1) != 1:
        tensor = tensor.contiguous()
    return tensor.view(torch.uint8).numpy()


def attention_tensors(layout: dict) -> set[str]:
    """Names of the full-attention keys and values among a layout's layers
    (checkpoints hold none): the tensors cut by tokens."""
    names = set()
    for i, meta in enumerate(layout.get("layers") or []):
        if not isinstance(meta, dict):
            continue
        first = meta if meta.get("kind") == "attention" else (meta.get("parts") or [{}])[0]
        if isinstance(first, dict) and first.get("kind") == "attention":
            names.update((f"layer.{i}.0", f"layer.{i}.1"))
    return names


def held_here(entries: dict, attention: set[str], local, have: int) -> dict:
    """For each full-attention tensor: (blocks, local tensor) where its first
    ``blocks`` token blocks lie within the ``have`` tokens ``local`` holds."""
    if local is None or have <= 0:
        return {}
    local_layout, local_tensors = encode_state(local, None)
    if local_layout is None or attention_tensors(local_layout) != attention:
        return {}
    held = {}
    for name in attention:
        entry, mine = entries[name], local_tensors[name]
        shape = [int(s) for s in entry["shape"]]
        if entry["split"] != "tokens" or str(mine.dtype).removeprefix("torch.") != entry["dtype"]:
            continue
        if mine.dim() != 4 or [*mine.shape[:2], mine.shape[3]] != [*shape[:2], shape[3]]:
            continue
        per_token = shape[0] * shape[1] * shape[3] * mine.element_size()
        blocks, tokens = 0, 0
        for size in entry["bytes"]:
            if tokens + size // per_token > min(have, mine.shape[2]):
                break
            blocks, tokens = blocks + 1, tokens + size // per_token
        if blocks:
            held[name] = (blocks, mine)
    return held


def assemble(entry: dict, data: dict[str, bytes], held: int = 0, local=None) -> torch.Tensor:
    """The tensor from its chunks; with ``held``, its first ``held`` blocks
    are the leading tokens of ``local`` (a tensor on the model's device)."""
    dtype = _dtype(entry["dtype"])
    shape = [int(s) for s in entry["shape"]]
    pieces = [data[d] for d in entry["chunks"][held:]]
    if len(entry["bytes"]) != len(entry["chunks"]) or entry["bytes"][held:] != [
        len(p) for p in pieces
    ]:
        raise ValueError("the chunk sizes the manifest lists are not the chunks' sizes")
    if entry["split"] == "bytes":
        flat = bytearray(b"".join(pieces))
        if not flat:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(flat, dtype=torch.uint8).view(dtype).reshape(shape)
    if entry["split"] != "tokens" or len(shape) != 4:
        raise ValueError(f"split {entry['split']!r} of a {len(shape)}-D tensor")
    with warnings.catch_warnings():
        # Read-only bytes, read once: torch.cat below copies them out.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        blocks = [
            torch.frombuffer(piece, dtype=torch.uint8)
            .view(dtype)
            .reshape(shape[0], shape[1], -1, shape[3])
            for piece in pieces
        ]
    tensor = torch.cat(blocks, dim=2) if blocks else None
    if held:  # joined on the model's device: what is held here never leaves it
        per_token = shape[0] * shape[1] * shape[3] * local.element_size()
        mine = local[:, :, : sum(entry["bytes"][:held]) // per_token]
        tensor = mine.clone() if tensor is None else torch.cat([mine, tensor.to(mine.device)], 2)
    if list(tensor.shape) != shape:
        raise ValueError(f"blocks make {list(tensor.shape)}, the manifest says {shape}")
    return tensor


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise StoreMiss("malformed", f"unknown dtype {name!r}")
    return dtype
