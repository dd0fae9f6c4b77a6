"""The decode batch: every active conversation's cache, merged so that one
forward decodes a token for each.

Layout (mlx-lm's ``BatchKVCache``, measured against a paged pool in
docs/ARCHITECTURE.md): each attention layer is one ``[rows, heads, columns,
dim]`` buffer in which every conversation's tokens end at the same column
``hi``; a shorter one is padded on the left with zeros that the attention mask
hides. A decode step writes one column for every row, so nothing already in
the buffer moves. Recurrent, conv and DeltaNet states are ``[rows, ...]``
buffers that the model updates in place.

- A conversation **joins** by copying its cache into a free row once (only
  when it is longer than every other does the batch grow its columns leftward,
  zeroing the new padding).
- It **leaves** by handing its session's cache only the tokens decoded since
  it joined (``layer.update``: an append), and copying its states back; the
  last row moves into its place, so the rows stay ``[0, rows)``.
- Columns run out rarely: the buffers are then rebuilt with headroom
  (amortized, like a growing array).

The buffers copy every decoding row's cache, so they count toward the
manager's ``max_cache_bytes``: ``on_bytes`` is told their size whenever they
are allocated, rebuilt or freed (the manager reserves it in its core).

Positions are each row's own token count, and the padded coordinates (what
the model's cache reports as its length) are shared: exactly what ``generate``
does for a left-padded batch, so every family's own mask code applies.

In a manager that compiles, the buffers are **static**
(``_StaticPaddedAttention``, ``DecodeBatch.static``), so that the compiled
step sees shapes and addresses that recur: rows in powers of two (doubled
when a row joins a full batch, halved or more once few are left: a lone row
decodes in a one-row batch), columns in the compiled decode's buckets, the
new column written at a position tensor, and every row (the unused ones
padding whose logits nobody reads) and every column given to the forward
with the mask. Since a static step reads every column, a joining row clears
its whole slot, and a row moving into a left row's slot copies all of it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
)

from ..bridge.layers import recurrent_slots
from ..bridge.static_cache import bucket

logger = logging.getLogger("kvchat")

_HEADROOM = 128  # columns added past the longest row when the buffers are (re)built


class _Geometry:
    """What every batched layer shares: rows in use, and columns [lo, hi);
    in a static batch also ``hi`` as a tensor, which its step writes at."""

    __slots__ = ("rows", "lo", "hi", "hi_t")

    def __init__(self):
        self.rows = self.lo = self.hi = 0
        self.hi_t: torch.Tensor | None = None


class _PaddedAttention:
    """Mixed in before a transformers attention layer class: its keys and
    values live in the batch's padded buffers (see the module docstring)."""

    _geo: _Geometry
    kbuf: torch.Tensor
    vbuf: torch.Tensor

    def update(self, key_states, value_states, *args, **kwargs):
        geo, n = self._geo, key_states.shape[-2]
        kv_length, _ = self.get_mask_sizes(n)
        end = geo.hi + n
        self.kbuf[: geo.rows, :, geo.hi : end] = key_states
        self.vbuf[: geo.rows, :, geo.hi : end] = value_states
        keys = self.kbuf[: geo.rows, :, end - kv_length : end]
        values = self.vbuf[: geo.rows, :, end - kv_length : end]
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        return self._geo.hi - self._geo.lo

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # As DynamicLayer / DynamicSlidingWindowLayer size them, over the padded length.
        padded = self._geo.hi - self._geo.lo
        if not self.is_sliding:
            return padded + query_length, 0
        window = self.sliding_window
        if padded >= window:
            return window - 1 + query_length, padded - window + 1
        return padded + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a decode batch is never cropped")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("rows leave a decode batch through DecodeBatch.leave")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("rows join a decode batch through DecodeBatch.join")


class _StaticPaddedAttention(_PaddedAttention):
    """The compiled batch's attention layer: the same buffers and columns,
    but every forward sees the same shapes (what a compiled step and a CUDA
    graph need). It writes the new column at a position tensor (``hi_t``) and
    returns every row and column of the buffers; the mask hides the columns
    a row has not written, a sliding layer's window included (the model's
    mask code draws it over the columns from the position)."""

    is_compileable = True  # the model's mask code then never looks at the mask's values

    def update(self, key_states, value_states, *args, **kwargs):
        position = self._geo.hi_t.reshape(1)
        self.kbuf.index_copy_(2, position, key_states)
        self.vbuf.index_copy_(2, position, value_states)
        self.keys, self.values = self.kbuf, self.vbuf
        return self.kbuf, self.vbuf

    def get_seq_length(self):
        # A tensor, as a StaticLayer's: a compiled step must not specialize on it.
        return self._geo.hi_t

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kbuf.shape[2], 0


_CLASSES: dict[tuple[type, bool], type] = {}


def _batched_class(cls: type, static: bool) -> type:
    if (cls, static) not in _CLASSES:
        mixin = _StaticPaddedAttention if static else _PaddedAttention
        prefix = "StaticBatched" if static else "Batched"
        _CLASSES[cls, static] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    return _CLASSES[cls, static]


def _rows_of(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``buffer``: the buffer itself when that is
    all of them, so that a static batch's layers hold the very tensor marked
    static (a view is another tensor to torch.compile: CUDA graphs were
    skipped for "mutated inputs" where a conv state was updated in place)."""
    return buffer if rows == buffer.shape[0] else buffer[:rows]


def unsupported_layer(cache) -> str | None:
    """Why a conversation with this cache cannot join a decode batch, or None."""
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicIndexedLayer):
            return f"layer {index} keeps indexer keys ({type(layer).__name__})"
        if isinstance(layer, DummyLayer):
            continue
        if not isinstance(layer, (DynamicLayer, LinearAttentionCacheLayerMixin)):
            return f"layer {index} is a {type(layer).__name__}"
        if isinstance(layer, DynamicLayer) and type(layer).__name__.startswith("Quant"):
            return f"layer {index} is quantized ({type(layer).__name__})"
    return None


def _attention(layer) -> bool:
    return isinstance(layer, DynamicLayer) and getattr(layer, "keys", None) is not None


def _slots(layer) -> tuple[tuple[str, int], ...]:
    """The layer's recurrent tensors, as (kind, state index); none for attention."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return ()
    return recurrent_slots(layer)


@contextlib.contextmanager
def _head_rows_padded(model, rows: int):
    """Runs the model's output head (a CPU ``nn.Linear`` in float32 or
    float64) on 4 rows instead of 2 or 3, 8 instead of 6 or 7, and so on,
    the batch's rows then zeros.

    On a CPU, torch's matrix product over a large vocabulary is much slower at
    those row counts than at the next multiple of four (RESULTS.md §25):
    SmolLM2's 49,152-token head takes 9.8 ms at one row, 23 and 36 ms at two
    and three, 17 at four; 26 and 39 at six and seven, 16 at eight. The
    padding rows' logits are dropped before anyone sees them. One row, a GPU,
    half precision and a compiled forward (whose guards would see the hooks
    come and go) run as they are."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    pad = -rows % 4
    if (
        rows == 1
        or pad not in (1, 2)
        or not isinstance(head, torch.nn.Linear)
        or head.weight.device.type != "cpu"
        or head.weight.dtype not in (torch.float32, torch.float64)
        or _compiled(model)
    ):
        yield
        return

    def padded(module, args):
        hidden = args[0] if args else None
        if hidden is None or hidden.shape[0] != rows:  # not this step's rows: left alone
            return None
        return (torch.cat([hidden, hidden.new_zeros((pad, *hidden.shape[1:]))]), *args[1:])

    def sliced(module, args, output):
        return output[:rows] if output.shape[0] == rows + pad else output

    handles = [head.register_forward_pre_hook(padded), head.register_forward_hook(sliced)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _compiled(model) -> bool:
    """Whether the user compiled the model (``torch.compile(model)`` or
    ``model.compile()``)."""
    return (
        type(model).__name__ == "OptimizedModule"
        or getattr(model, "_compiled_call_impl", None) is not None
        or hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable")
    )


class DecodeBatch:
    """The rows decoding together and their merged cache (module docstring).
    Used by the engine's thread alone."""

    def __init__(
        self,
        new_cache,
        cache_argument: str,
        takes_mask: bool,
        takes_positions: bool,
        on_bytes: Callable[[int], None] | None = None,
    ):
        """``new_cache()``: an empty cache of the model's layer classes.
        ``on_bytes(n)``: called with ``nbytes()`` each time the buffers are
        allocated, rebuilt or freed (never per step); may be set later."""
        self.on_bytes = on_bytes
        self._reported = 0
        # The buffers' bytes as last allocated, grown or freed: what other
        # threads read (stats()), never the buffers the engine is changing.
        self.bytes_now = 0
        self._new_cache = new_cache
        self._argument = cache_argument
        self._takes_mask, self._takes_positions = takes_mask, takes_positions
        self.rows: list = []  # DecodeRow, by slot
        self._cache = None
        self._geo = _Geometry()
        # The manager's ``CompiledDecode`` (compiled.py) when it compiles;
        # buffers allocated while it is enabled are static
        # (``_StaticPaddedAttention``) until freed, and its steps compiled.
        self.compiled = None
        self.static = False

    # ------------------------------------------------------------ layout
    def _allocate(
        self, template, row_capacity: int, padded: int, columns: int | None = None
    ) -> None:
        """Empty buffers shaped after ``template`` (a row's cache), with room
        for ``padded`` columns and headroom (or exactly ``columns``)."""
        cache = self._new_cache()
        self.static = self.compiled is not None and self.compiled.batch_compiles
        columns = columns or self._columns_for(padded)
        self._attention, self._recurrent = [], []  # (layer index) / (layer index, kind, idx)
        for index, (layer, source) in enumerate(zip(cache.layers, template.layers, strict=True)):
            if _attention(source):
                keys, values = source.keys, source.values
                batched = object.__new__(_batched_class(type(layer), self.static))
                batched.__dict__.update(layer.__dict__)
                cache.layers[index] = layer = batched
                layer._geo = self._geo
                layer.kbuf = keys.new_zeros((row_capacity, keys.shape[1], columns, keys.shape[3]))
                layer.vbuf = values.new_zeros(
                    (row_capacity, values.shape[1], columns, values.shape[3])
                )
                layer.is_initialized = True
                layer.device = keys.device
                self._attention.append(index)
            for kind, i in _slots(source):
                state = getattr(source, f"{kind}_states")[i]
                buffer = state.new_zeros((row_capacity, *state.shape[1:]))
                layer_states = getattr(layer, f"{kind}_states")
                layer_states[i] = buffer
                getattr(layer, f"is_{kind}_states_initialized")[i] = True
                layer.has_previous_state[i] = True
                if kind == "conv":
                    layer.conv_kernel_size[i] = state.shape[-1]
                layer.device, layer.dtype = state.device, state.dtype
                self._recurrent.append((index, kind, i, buffer))
        device = next(buffer for buffer, _ in self._buffers_of(cache)).device
        self._cache = cache
        self._columns, self._row_capacity = columns, row_capacity
        self._mask = torch.zeros((row_capacity, columns), dtype=torch.long, device=device)
        self._positions = torch.zeros((row_capacity, 1), dtype=torch.long, device=device)
        self._tokens = torch.zeros((row_capacity, 1), dtype=torch.long, device=device)
        if self.static:
            self._geo.hi_t = torch.zeros((), dtype=torch.long, device=device)
            self._mark_static()
        self._report()

    def _columns_for(self, padded: int) -> int:
        """Room for ``padded`` columns and headroom: a static batch's from the
        compiled decode's buckets, so its shapes (and graphs) recur."""
        if self.static:
            return bucket(padded + _HEADROOM)
        return padded + max(_HEADROOM, padded // 2)

    def _mark_static(self) -> None:
        """A static batch's tensors keep their addresses from step to step:
        said to torch.compile, so CUDA graphs replay on them without copies.
        Their columns, and their rows where there are several, are dynamic
        sizes from the first compile: a later bucket or row count compiles
        nothing (dynamo would otherwise compile once more, on seeing a size
        change: a conversation's second turn in the next bucket did). One
        row stays apart, as dynamo specializes sizes of 1."""
        for buffer, column_dim in self._buffers():
            torch._dynamo.mark_static_address(buffer)
            if column_dim is not None:
                torch._dynamo.maybe_mark_dynamic(buffer, column_dim)
            if self._row_capacity > 1:
                torch._dynamo.maybe_mark_dynamic(buffer, 0)
        torch._dynamo.mark_static_address(self._geo.hi_t)

    def _buffers_of(self, cache):
        """The layers' per-row buffers, each with its column dim (None: none)."""
        for index in self._attention:
            layer = cache.layers[index]
            yield layer.kbuf, 2
            yield layer.vbuf, 2
        for _, _, _, buffer in self._recurrent:
            yield buffer, None

    def _buffers(self):
        """Every per-row buffer: the layers', then the mask (columns at dim 1),
        the positions and the tokens."""
        yield from self._buffers_of(self._cache)
        yield self._mask, 1
        yield self._positions, None
        yield self._tokens, None

    def _rebuild(self, row_capacity: int, padded: int) -> None:
        """New buffers of ``row_capacity`` rows and room for ``padded`` columns
        plus headroom, the rows copied in ending at the new ``hi``."""
        geo, old = self._geo, list(self._buffers())
        columns = self._columns_for(padded)
        used = geo.hi - geo.lo
        # The recurrent buffers are replaced in place in their layers below.
        replaced = []
        for buffer, column_dim in old:
            shape = list(buffer.shape)
            shape[0] = row_capacity
            if column_dim is not None:
                shape[column_dim] = columns
            new = buffer.new_zeros(shape)
            rows = geo.rows
            if column_dim is None:
                new[:rows] = buffer[:rows]
            elif column_dim == 1:
                new[:rows, padded - used : padded] = buffer[:rows, geo.lo : geo.hi]
            else:
                new[:rows, :, padded - used : padded] = buffer[:rows, :, geo.lo : geo.hi]
            replaced.append(new)
        it = iter(replaced)
        for index in self._attention:
            layer = self._cache.layers[index]
            layer.kbuf, layer.vbuf = next(it), next(it)
        recurrent = []
        for index, kind, i, _ in self._recurrent:
            buffer = next(it)
            getattr(self._cache.layers[index], f"{kind}_states")[i] = buffer
            recurrent.append((index, kind, i, buffer))
        self._recurrent = recurrent
        self._mask, self._positions, self._tokens = next(it), next(it), next(it)
        self._columns, self._row_capacity = columns, row_capacity
        geo.lo, geo.hi = padded - used, padded
        self._link()
        if self.static:
            self._mark_static()
        self._report()

    def _report(self) -> None:
        """Tells ``on_bytes`` the buffers' size when it changed. A callback
        that fails is logged, not raised: accounting never fails the rows."""
        nbytes = self.bytes_now = self.nbytes()
        if self.on_bytes is None or nbytes == self._reported:
            return
        try:
            self.on_bytes(nbytes)
        except Exception:
            logger.exception("kvchat: could not report the decode batch's %d bytes", nbytes)
            return
        self._reported = nbytes

    def _link(self) -> None:
        """Points the layers' recurrent states at the rows in use (a static
        batch's forward runs every row)."""
        rows = self._row_capacity if self.static else self._geo.rows
        for index, kind, i, buffer in self._recurrent:
            getattr(self._cache.layers[index], f"{kind}_states")[i] = _rows_of(buffer, rows)

    def shape(self, template, rows: int, columns: int, length: int) -> None:
        """An empty batch's buffers, made for ``rows`` rows of ``length``
        tokens (each cache like ``template``) in ``columns`` columns: a
        warm-up's, so that its steps run the shape it compiles for."""
        if self._cache is not None:
            raise RuntimeError("only an empty batch is shaped")
        self._allocate(template, rows, length, columns)
        self._geo.rows, self._geo.lo, self._geo.hi = 0, length, length

    # ------------------------------------------------------------ rows
    def join(self, row) -> None:
        """Copies ``row.cache`` (which holds ``row.length`` tokens) into a free row."""
        length, cache = row.length, row.cache
        geo = self._geo
        if self._cache is None:
            self._allocate(cache, 1, length)
            geo.rows, geo.lo, geo.hi = 0, length, length
        full = geo.rows == self._row_capacity
        if full or length > geo.hi:  # rows or left columns run out: rebuilt, rarely
            capacity = 2 * self._row_capacity if full else self._row_capacity
            self._rebuild(capacity, max(length, geo.hi - geo.lo))
        if geo.hi - length < geo.lo:  # longer than every row: pad the others further
            new_lo = geo.hi - length
            for buffer, column_dim in self._buffers():
                if column_dim == 2:
                    buffer[: geo.rows, :, new_lo : geo.lo] = 0
                elif column_dim == 1:
                    buffer[: geo.rows, new_lo : geo.lo] = 0
            geo.lo = new_lo
        slot, start = geo.rows, geo.hi - length
        for index in self._attention:
            layer, source = self._cache.layers[index], cache.layers[index]
            n = source.keys.shape[-2]
            for buffer, part in ((layer.kbuf, source.keys), (layer.vbuf, source.values)):
                if self.static:
                    # A static step reads every column, and a masked NaN or
                    # inf (a padding row's, a left row's) still poisons the
                    # attention (0 x inf): the whole slot is cleared.
                    buffer[slot] = 0
                else:
                    buffer[slot, :, geo.lo : geo.hi - n] = 0
                buffer[slot, :, geo.hi - n : geo.hi] = part[0]
        for index, kind, i, buffer in self._recurrent:
            buffer[slot] = getattr(cache.layers[index], f"{kind}_states")[i][0]
        # The whole row: a static step reads every column of the mask.
        self._mask[slot, :start] = 0
        self._mask[slot, start : geo.hi] = 1
        self._positions[slot] = length
        self._tokens[slot] = row.ids[0, -1]
        # Counted in tokens, not columns: a rebuild moves the columns.
        row.slot, row.joined_length = slot, length
        self.rows.append(row)
        geo.rows += 1
        self._link()

    def leave(self, row, write_back: bool = True) -> None:
        """Takes ``row`` out; with ``write_back``, its session's cache gets the
        tokens decoded since it joined and its recurrent states."""
        geo, slot = self._geo, row.slot
        decoded = row.length - row.joined_length
        if write_back:
            cache = row.cache
            for index in self._attention:
                layer = self._cache.layers[index]
                if decoded:
                    # Views: the session's layer copies them (an append or a cat).
                    keys = layer.kbuf[slot : slot + 1, :, geo.hi - decoded : geo.hi]
                    values = layer.vbuf[slot : slot + 1, :, geo.hi - decoded : geo.hi]
                    cache.layers[index].update(keys, values)
            for index, kind, i, buffer in self._recurrent:
                getattr(cache.layers[index], f"{kind}_states")[i].copy_(buffer[slot : slot + 1])
        last = geo.rows - 1
        if slot != last:  # the last row moves into the hole
            moved = self.rows[last]
            for buffer, column_dim in self._buffers():
                if column_dim == 2 and not self.static:
                    buffer[slot, :, geo.lo : geo.hi] = buffer[last, :, geo.lo : geo.hi]
                else:  # the whole row: a static step reads every column (see join)
                    buffer[slot] = buffer[last]
            self.rows[slot] = moved
            moved.slot = slot
        self.rows.pop()
        row.slot = None
        geo.rows -= 1
        if not self.rows:  # nothing decodes: the memory goes back
            self._free()
            return
        # The padding every row now has on its left is dropped from the mask.
        geo.lo = max(geo.lo, geo.hi - max(r.length for r in self.rows))
        if (
            self.static
            and self._row_capacity > 1
            and (geo.rows == 1 or 4 * geo.rows <= self._row_capacity)
        ):
            # A static step runs every row it has room for: fewer once most
            # left, and one alone (a lone conversation's every step).
            self._rebuild(1 << (geo.rows - 1).bit_length(), geo.hi - geo.lo)
        self._link()

    def _free(self) -> None:
        self._cache = None
        self._attention, self._recurrent = [], []
        self._mask = self._positions = self._tokens = self._geo.hi_t = None
        self._report()

    def set_token(self, row, token: torch.Tensor) -> None:
        self._tokens[row.slot] = token.reshape(1)

    # ------------------------------------------------------------ the step
    def step(self, model, extra: dict) -> torch.Tensor:
        """One forward over every row's last token; the float32 logits ``[rows, vocab]``."""
        geo = self._geo
        if geo.hi == self._columns:
            self._rebuild(self._row_capacity, geo.hi - geo.lo)
        rows = geo.rows
        kwargs = {self._argument: self._cache, "use_cache": True, **extra}
        if self.static:
            outputs = self._static_forward(model, kwargs)
        else:
            self._mask[:rows, geo.hi] = 1
            # No row padded: no mask, as generate passes none (and the model's
            # mask code then needs no look at it, a device sync on a GPU).
            padded = any(row.length < geo.hi - geo.lo for row in self.rows)
            if self._takes_mask and padded:
                kwargs["attention_mask"] = self._mask[:rows, geo.lo : geo.hi + 1]
            if self._takes_positions:
                kwargs["position_ids"] = self._positions[:rows]
            with _head_rows_padded(model, rows):
                outputs = model(input_ids=self._tokens[:rows], return_dict=True, **kwargs)
        geo.hi += 1
        self._positions[:rows] += 1
        for row in self.rows:
            row.length += 1
        # A model that assigns its states rather than copying into them
        # leaves the batch's buffers behind: copied back, so none is lost.
        linked = self._row_capacity if self.static else rows
        for index, kind, i, buffer in self._recurrent:
            states = getattr(self._cache.layers[index], f"{kind}_states")
            if states[i].data_ptr() != buffer.data_ptr():
                buffer[:linked].copy_(states[i])
                states[i] = _rows_of(buffer, linked)
        return outputs.logits[:rows, -1].to(copy=True, dtype=torch.float32)

    def _static_forward(self, model, kwargs: dict):
        """The step of a static batch: every row of the buffers, every column
        (the rows past ``rows`` are padding whose logits nobody reads; each
        attends at least to its own column, so none divides by zero), and
        only tensors whose shapes and addresses stay, the mask always given."""
        geo = self._geo
        self._mask[:, geo.hi] = 1
        geo.hi_t.fill_(geo.hi)
        if self._takes_mask:
            kwargs["attention_mask"] = self._mask
        if self._takes_positions:
            kwargs["position_ids"] = self._positions
        kwargs.update(input_ids=self._tokens, return_dict=True)
        if self.compiled is not None and self.compiled.enabled:  # not after a failed compile
            return self.compiled.batch_forward(model, kwargs, tuple(self._mask.shape))
        return model(**kwargs)

    def reset(self) -> None:
        """Forgets every row and frees the buffers: a batch a failure left in
        a state no row can leave from."""
        for row in self.rows:
            row.slot = None
        self.rows = []
        self._geo.rows = self._geo.lo = self._geo.hi = 0
        self._free()

    def nbytes(self) -> int:
        if self._cache is None:
            return 0
        return sum(buffer.numel() * buffer.element_size() for buffer, _ in self._buffers())
