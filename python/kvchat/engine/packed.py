"""Linear layers run through oneDNN with their weights packed once, on the
engine's thread, on a CPU.

Why: this torch's default CPU matrix product (MKL) over a few rows costs far
more than over one: SmolLM2's 1536x576 projection takes 70 us for one row and
175 us for four, its 49,152-token output head 9.7 ms and 14.9 ms. oneDNN's
linear over weights reordered once for it takes 45 and 61 us, 3.2 and 2.6 ms
(``benchmarks/batch_layout.py``). So the batched decode step, whose cost is mostly
these products, costs about what a lone row's does (RESULTS §27).

What it costs: a copy of each packed weight, held while a manager uses the
model (``stats().packed_weight_bytes``), and results that differ from the
default product's by float rounding (the same order as the batch's own shape
already changes them): so only float32 is packed unless asked, never float64,
which the exact tests use.

The model's own modules get a ``forward`` that takes the packed path only on
an engine's thread that packs (``on_this_thread``), with gradients and
autocast off and oneDNN on, for an input of the packed dtype, while the
module's weight is the very tensor that was packed, unchanged (same object,
data and version): a weight the user loads, trains or moves is repacked or,
off the CPU, left to ``nn.Linear``. A change no version counter sees
(``weight.data.copy_(...)``, peft's merge, an inference tensor's) is found
by a sum of bits picked in every row and column of the weight (``verify``),
which the engine's thread checks as turns start with no other turn running
(about 6 ms for SmolLM2), and which a manager sharing another's copies
checks when it is built.
Everywhere else, including the user's own calls to the model, the module
runs as before.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch
from torch import nn

logger = logging.getLogger("kvchat")

# "auto" packs weights of at least this many elements: below it oneDNN's
# fixed cost per call outweighs what it saves (SmolLM2's 192x576 key and
# value projections are slower packed at one row).
AUTO_MIN_ELEMENTS = 1 << 18
# oneDNN reorders for an expected number of rows; 4 suits 1 to 8 rows about
# equally (measured: one row is no slower than the default product).
ROWS_HINT = 4
# The dtypes "auto" and True pack; never float64 (module docstring).
AUTO_DTYPES = (torch.float32,)
DTYPES = (torch.float32, torch.bfloat16)

_thread = threading.local()
# Installing and removing forwards, and their users counts: managers of one
# model may be built or closed on several threads at once.
_INSTALL = threading.RLock()  # reentrant: a collected engine may release inside an install


def on_this_thread(packs: bool) -> None:
    """Called by an engine's thread once: whether its forwards take the packed path."""
    _thread.packs = packs


def available() -> bool:
    """Whether this torch has oneDNN's packed linear (a CPU build with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _bfloat16_supported() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 (avx512bw/vl/dq or newer)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_pack_weights(pack_weights: bool | str) -> None:
    """``SessionManager(pack_weights=)``: "auto", True or False, else ValueError naming it."""
    if isinstance(pack_weights, bool) or (isinstance(pack_weights, str) and pack_weights == "auto"):
        return
    raise ValueError(f"pack_weights must be 'auto', True or False, got {pack_weights!r}")


class _PackedForward:
    """A Linear module's forward: packed where it may be (module docstring)."""

    def __init__(self, module: nn.Linear):
        self.module = module
        self.users = 0  # engines that use it: the last to release it removes it
        self.dtype = module.weight.dtype  # packed; the weight's may change (model.double())
        self._pack(module.weight)

    def _pack(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        # One assignment, after the reorder: another engine's thread sharing
        # this forward never sees the new weight's marks with the old copy.
        self.state = (weight, weight.data_ptr(), _version(weight), _bits(weight), packed)

    @property
    def nbytes(self) -> int:
        return self.state[0].numel() * self.dtype.itemsize

    def verify(self) -> None:
        """Packs the weight again if its bits changed, also where no version
        counter saw it (``weight.data.copy_(...)``, peft's merge)."""
        bits = self.state[3]
        now = self.module.weight
        if now.device.type == "cpu" and now.dtype == self.dtype and _bits(now) != bits:
            logger.debug("kvchat: a packed weight changed; packing it again")
            self._pack(now)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: input=
        module = self.module
        weight = module.weight
        packed_weight, data_ptr, version, _, packed = self.state
        if (
            getattr(_thread, "packs", False)
            and not torch.is_grad_enabled()
            and torch.backends.mkldnn.enabled  # the user may turn oneDNN off
            and not torch.is_autocast_enabled("cpu")  # autocast's dtype, as nn.Linear
            and input.dtype == self.dtype
            and input.device.type == "cpu"
            and weight.device.type == "cpu"
            and weight.dtype == self.dtype
        ):
            if (
                weight is not packed_weight
                or weight.data_ptr() != data_ptr
                or _version(weight) != version
            ):
                logger.debug("kvchat: a packed weight changed; packing it again")
                self._pack(weight)
                packed = self.state[4]
            return torch.ops.mkldnn._linear_pointwise(input, packed, module.bias, "none", [], "")
        return nn.Linear.forward(module, input)

    def __reduce__(self):
        # A copy of a module in use (copy.deepcopy, pickle as torch.save does)
        # gets nn.Linear's own forward: no packed copy, nothing of kvchat.
        return functools.partial, (nn.Linear.forward, self.module)


def _plain(forward, module: nn.Module) -> bool:
    """No forward of its own, or the one a copy of a packed module got."""
    return forward is None or (
        isinstance(forward, functools.partial)
        and forward.func is nn.Linear.forward
        and len(forward.args) == 1
        and forward.args[0] is module
        and not forward.keywords
    )


def _version(weight: torch.Tensor) -> int:
    # An inference tensor has no version counter (changed only in
    # inference_mode, which verify's bits see).
    return -1 if weight.is_inference() else weight._version


def _bits(weight: torch.Tensor) -> int:
    """A sum of the bits of one element in each column of the weight and in
    each row (at most 4,096 rows), so that a change to the whole weight (a
    checkpoint written through ``.data``, an adapter merged) or to any
    column moves it. Summing every element would cost about a decode step
    each time turns start (SmolLM2: 20 ms); these picks, about 6 ms for its
    151 packed weights. A change
    to a few elements can go unseen: a changed weight needs a new manager
    anyway, as its sessions' caches do (docs/how-it-works.md)."""
    flat = weight.detach().reshape(-1)
    picked = flat[_picks(*weight.shape)].view(_SAME_SIZE_INT[flat.element_size()])
    return int(picked.sum(dtype=torch.int64))


@functools.lru_cache(maxsize=64)
def _picks(rows: int, columns: int) -> torch.Tensor:
    """The flat positions ``_bits`` reads: spread by primes, so that they
    fall on neither the diagonal nor one band. At most 4,096 rows: an output
    head's 49,152 scattered reads alone would cost 3 ms."""
    r, c = torch.arange(0, rows, max(1, rows // 4096)), torch.arange(columns)
    return torch.cat([r * columns + (r * 7919) % columns, ((c * 104729) % rows) * columns + c])


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _eligible(module: nn.Module, dtypes, min_elements: int) -> bool:
    if type(module) is not nn.Linear:  # subclasses (quantized, LoRA) compute otherwise
        return False
    forward = module.__dict__.get("forward")
    if not (_plain(forward, module) or isinstance(forward, _PackedForward)):
        return False  # someone else's override (accelerate's hooks): theirs stands
    weight = module.weight
    return (
        weight.device.type == "cpu"
        and weight.dtype in dtypes
        and weight.numel() >= min_elements
        and (module.bias is None or module.bias.dtype == weight.dtype)
    )


def _available_bytes() -> int | None:
    """Memory available for a new copy: Linux's MemAvailable (free memory
    plus the page cache it can drop), else the free pages, else unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class PackedWeights:
    """The packed forwards one engine installed on its model's modules."""

    def __init__(self, model, pack_weights: bool | str = "auto", compiled: bool = False):
        self.forwards: list[_PackedForward] = []
        self.why_not = self._why_not(model, pack_weights, compiled)
        if self.why_not is not None:
            if pack_weights is True:
                logger.info("kvchat: weights not packed: %s", self.why_not)
            return
        dtypes = DTYPES if pack_weights is True else AUTO_DTYPES
        if not _bfloat16_supported():  # oneDNN refuses to pack it here
            dtypes = tuple(d for d in dtypes if d != torch.bfloat16)
        min_elements = 0 if pack_weights is True else AUTO_MIN_ELEMENTS
        modules = [m for m in model.modules() if _eligible(m, dtypes, min_elements)]
        # What this engine would add: a copy another engine made is shared.
        new_bytes = sum(
            m.weight.numel() * m.weight.element_size()
            for m in modules
            if not isinstance(m.__dict__.get("forward"), _PackedForward)
        )
        free = _available_bytes()
        if pack_weights == "auto" and free is not None and new_bytes > free // 2:
            self.why_not = (
                f"a packed copy of the weights needs {new_bytes} bytes, "
                f"more than half the {free} bytes of memory available"
            )
            logger.info("kvchat: weights not packed: %s", self.why_not)
            return
        with _INSTALL:
            try:
                for module in modules:
                    forward = module.__dict__.get("forward")
                    if not isinstance(forward, _PackedForward):
                        forward = _PackedForward(module)
                        module.forward = forward
                    else:  # another manager's, shared: its weights may have changed since
                        forward.verify()
                    forward.users += 1
                    self.forwards.append(forward)
            except BaseException:  # no engine will hold these to release them
                self._release_locked()
                raise
        if not self.forwards:
            self.why_not = "no linear layer qualifies"
        else:
            logger.info(
                "kvchat: %d linear layers run on weights packed for oneDNN (%d bytes)",
                len(self.forwards),
                self.nbytes,
            )

    @staticmethod
    def _why_not(model, pack_weights: bool | str, compiled: bool) -> str | None:
        if pack_weights is False:
            return "pack_weights=False"
        if compiled or hasattr(model, "_orig_mod"):  # compile=True, or torch.compile(model)
            return "a compiled model (torch.compile packs what it needs)"
        if not available():
            return "this torch has no oneDNN"
        if not torch.backends.mkldnn.enabled:
            return "oneDNN is turned off (torch.backends.mkldnn.enabled)"
        device = getattr(model, "device", None)
        if not isinstance(device, torch.device) or device.type != "cpu":
            return f"the model is on {device}, not the CPU"
        return None

    @property
    def packs(self) -> bool:
        return bool(self.forwards)

    @property
    def nbytes(self) -> int:
        return sum(forward.nbytes for forward in self.forwards)

    def verify(self) -> None:
        """Packs again the weights whose bits changed (_PackedForward.verify):
        the engine's thread calls it as turns start (loop.py)."""
        for forward in self.forwards:
            forward.verify()

    def release(self) -> None:
        """Removes this engine's forwards: the modules run as before, and
        the copies are freed, once no other engine uses them."""
        with _INSTALL:
            self._release_locked()

    def _release_locked(self) -> None:
        for forward in self.forwards:
            forward.users -= 1
            if forward.users == 0 and forward.module.__dict__.get("forward") is forward:
                del forward.module.forward
        self.forwards = []
