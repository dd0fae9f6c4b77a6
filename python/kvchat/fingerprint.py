"""The model fingerprint: what must match for a saved cache to be valid for a model.

A cache is only valid for the exact weights that computed it, so the
fingerprint covers every parameter and buffer (PEFT adapters, loaded or merged,
included): each tensor's name, shape and dtype, and two exact sums of its
contents computed where it lives. One pass over the weights, on the device: no
copy to the host and no Python loop over elements.

The sums are not a cryptographic hash: they tell any accidental difference
(another checkpoint, one changed value, a fine-tune, permuted rows) from the
same weights, which is what a cache needs; they are not a defence against a
file crafted to collide.
"""

from __future__ import annotations

import hashlib
import json
import re

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# Config entries that differ between two loads of one model, or do not affect its KV.
_VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash")
_CHUNK = 1 << 22  # elements summed at once: bounds the temporary memory per tensor
# An odd 64-bit constant (the golden ratio's): position i weighs i * _MIX mod 2**64,
# so moving values around changes the weighted sum too.
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)
_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _to_int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def _content_sums(tensor: torch.Tensor, weights_by_device: dict) -> tuple[int, int]:
    """(sum, position-weighted sum) of the tensor's raw words, mod 2**64.

    Position i weighs i * _MIX. Per chunk starting at s that is
    sum(w_j * (j * _MIX)) + s * _MIX * sum(w_j), so one weight vector per device
    (kept in ``weights_by_device`` for one fingerprint) serves every chunk."""
    flat = tensor.detach().reshape(-1)
    words = flat.view(_AS_INTEGERS[flat.element_size()])
    device = flat.device
    if device not in weights_by_device:
        weights_by_device[device] = torch.arange(_CHUNK, dtype=torch.int64, device=device)
        weights_by_device[device].mul_(_MIX)
    weights = weights_by_device[device]
    plain, weighted = 0, 0
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        # Not in place: for 8-byte dtypes `chunk` is a view of the weights themselves.
        chunk_sum = int(chunk.sum())
        plain += chunk_sum
        weighted += int((chunk * weights[: chunk.numel()]).sum()) + start * _MIX * chunk_sum
    return _to_int64(plain), _to_int64(weighted)


def _sums(tensor: torch.Tensor, weights_by_device: dict):
    """The content sums of a tensor; None on the meta device. A tensor
    subclass that wraps others (a quantized weight: torchao's int8 data and
    scales) has no raw words of its own to view: its class, its settings (how
    it quantizes activations, its block size: two models with equal data may
    compute differently) and each inner tensor's shape, dtype and sums."""
    if is_traceable_wrapper_subclass(tensor):
        names, context = tensor.__tensor_flatten__()
        inner = {}
        for name in names:
            part = getattr(tensor, name)
            inner[name] = [list(part.shape), str(part.dtype), _sums(part, weights_by_device)]
        kind = f"{type(tensor).__module__}.{type(tensor).__qualname__}"
        # repr, less any memory address, so the same settings read the same in any process.
        return [kind, re.sub(r" at 0x[0-9a-fA-F]+", "", repr(context)), inner]
    return None if tensor.is_meta else _content_sums(tensor, weights_by_device)


def weights_checksum(model) -> str:
    """A digest of every parameter and buffer: names, shapes, dtypes and contents."""
    digest = hashlib.sha256()
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    weights_by_device: dict = {}
    for name, tensor in tensors:
        sums = _sums(tensor, weights_by_device)
        digest.update(json.dumps([name, list(tensor.shape), str(tensor.dtype), sums]).encode())
    return digest.hexdigest()


def model_fingerprint(model, layer_classes: list[str]) -> dict:
    """What must match for a saved cache to be valid for ``model``."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG}
    config_json = json.dumps(config, sort_keys=True, default=str)
    return {
        "model_type": model.config.model_type,
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
        "dtype": str(next(model.parameters()).dtype),
        "layer_classes": layer_classes,
        "weights": weights_checksum(model),
    }
