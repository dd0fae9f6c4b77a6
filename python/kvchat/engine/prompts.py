"""Prompts that start together: a prefix one row holds copied into another,
and several rows' prompts prefilled in one forward.

Turns that start at the same moment (a server's clients, an agent framework's
parallel calls) would each prefill their whole prompt, one after another, and
the last one's first token would wait for them all. The core shares a prefix
between sessions only once a turn has committed, too late for these.

- **A prefix in flight** (``copy_prefix``). A row whose prompt begins with
  tokens another row of the engine already holds (the system prompt of tool
  descriptions every agent conversation sends) takes their keys and values
  from that row's cache instead of computing them again. A key or value
  depends only on the tokens before it, so they are what its own forward
  would give.
- **One forward for several prompts** (``prefill_together``). The rows' past
  is merged left-padded to the longest, their new tokens follow, and a row
  with fewer new tokens is padded on the right (at its last position, so no
  position passes its own). No real token attends to that padding (it comes
  after it), and the mask hides the left padding, so each row's keys, values
  and logits are its own. The new keys and values are
  appended to each row's own cache, which then joins the decode batch.

Both need every layer to be full attention (``full_attention_only``): a
sliding-window layer keeps only its window, so the columns a copy or a merge
needs may be gone, and a conv or recurrent state exists only at the position
its row reached. Where conv, SSM or DeltaNet layers stand beside full
attention (LFM2, Qwen3.5, FalconH1, NemotronH), a row still copies a prefix
in flight, up to a checkpoint another row took (``copy_checkpoint``): the
attention columns from that row's cache, the other layers' states from the
checkpoint, which is what the row's own prefill would have stopped and
snapshotted there. Both assume a token's keys and values follow from the token
ids before it and their positions (so no image placeholders: a turn with
extra model inputs never reaches the engine's batch).

A row copies only from rows of its own share scope (``share_scope``): the
manager's ``share_prefixes`` and ``isolate_namespaces`` hold here as in the
core, so one tenant's prompt never starts from another's.
"""

from __future__ import annotations

import torch

from .. import _C
from ..bridge.layers import write_recurrent
from ..bridge.layout import ATTENTION, RECURRENT

# A row waits for another row's forward, rather than prefilling beside it,
# when that forward computes at least this many tokens of its prompt; and
# copies a prefix only this long or longer (the manager's min_shared_tokens,
# 32 by default, replaces it).
SHARE_MIN_TOKENS = 32


def share_scope(session_id: str, min_shared_tokens: int, isolate_namespaces: bool) -> str | None:
    """Which rows a session's rows may copy prefixes from: those of the same
    scope, as the core's sharing (``SessionManager::share_scope``): every
    session's ("") or, with ``isolate_namespaces``, its namespace's ("a/" of
    "a/b"; an id without one is its own). None: none (sharing is off)."""
    if min_shared_tokens <= 0:
        return None
    if not isolate_namespaces:
        return ""
    slash = session_id.find("/")
    return session_id + "/" if slash < 0 else session_id[: slash + 1]


def shares_with(row, other) -> bool:
    return row.share_scope is not None and row.share_scope == other.share_scope


def full_attention_only(layout) -> bool:
    """Whether every layer of the model's cache is full attention (or none)."""
    return (
        layout.supported
        and not layout.indexed
        and all(parts in ((ATTENTION,), ()) for parts in layout.parts)
    )


def held_tokens(row) -> int:
    """The prompt tokens ``row.cache`` holds now: those it joined the decode
    batch with (what it decodes stays in the batch's buffers until it leaves),
    else those prefilled."""
    return row.joined_length if row.slot is not None else row.prefilled


def common_prefix(row, other, limit: int) -> int:
    """How many of the first ``limit`` tokens ``row`` and ``other`` share."""
    # The CPU copies (a comparison on a GPU would wait for it, every pass).
    limit = max(limit, 0)
    return _C.common_prefix_length(row.prompt_ids[:limit], other.prompt_ids[:limit])


def copy_prefix(row, donors, minimum: int = 1) -> int:
    """Appends to ``row.cache`` the keys and values of the longest prefix of
    its prompt that one of ``donors`` holds past what ``row`` holds (at least
    ``minimum`` tokens, and never its last prompt token, whose logits it
    needs); returns how many tokens it copied."""
    best, end = None, row.prefilled + minimum - 1
    for donor in donors:
        if donor is row or not shares_with(row, donor):
            continue
        shared = common_prefix(row, donor, min(held_tokens(donor), row.prompt_tokens - 1))
        if shared > end:
            best, end = donor, shared
    if best is None:
        return 0
    begin = row.prefilled
    for mine, theirs in zip(row.cache.layers, best.cache.layers, strict=True):
        if getattr(theirs, "keys", None) is None:  # a layer with no cache
            continue
        # update copies (into the row's buffer): the views need no copy first.
        mine.update(theirs.keys[:, :, begin:end], theirs.values[:, :, begin:end])
    row.prefilled = row.length = end
    return end - begin


def checkpoint_copies(layout) -> bool:
    """Whether rows may copy a prefix up to a checkpoint (``copy_checkpoint``):
    every layer full attention, conv / SSM / DeltaNet, both, or none, and at
    least one that is not attention (for attention alone, ``copy_prefix``)."""
    if not layout.supported or layout.indexed:  # an unsupported layout has no parts
        return False
    parts = [set(p) for p in layout.parts]
    return all(p <= {ATTENTION, RECURRENT} for p in parts) and any(RECURRENT in p for p in parts)


def checkpoint_to_copy(row, donors, minimum: int = 1):
    """(donor, checkpoint) for ``copy_checkpoint``: the furthest checkpoint one
    of ``donors`` took at least ``minimum`` tokens past what ``row`` holds,
    within the prompt both share, before ``row``'s last prompt token, and
    not past the first position ``row`` must stop at (``row.stops``, or the
    positions its windows would read); None if there is none."""
    end, first_stop = _copy_bounds(row, minimum)
    best = None
    for donor in donors:
        if donor is row or not shares_with(row, donor) or not donor.checkpoints:
            continue
        shared = common_prefix(row, donor, min(held_tokens(donor), row.prompt_tokens - 1))
        for checkpoint in donor.checkpoints:
            p = checkpoint.position
            if end < p <= shared and (first_stop is None or p <= first_stop):
                best, end = (donor, checkpoint), p
    return best


def _copy_bounds(row, minimum: int) -> tuple[int, int | None]:
    """A copy for ``row`` ends past the first and at or before the second
    (the first position it must stop at; None: anywhere)."""
    stops = row.windows.positions if row.windows is not None else row.stops
    first_stop = next((p for p in stops if p > row.prefilled), None)
    return row.prefilled + minimum - 1, first_stop


def would_copy(row, donor, positions, minimum: int = 1) -> bool:
    """Whether ``row`` would copy from ``donor`` (``checkpoint_to_copy``) up
    to a checkpoint ``donor`` would take at one of ``positions``."""
    if donor is row or not shares_with(row, donor):
        return False
    low, first_stop = _copy_bounds(row, minimum)
    shared = common_prefix(row, donor, row.prompt_tokens - 1)
    return any(low < p <= shared and (first_stop is None or p <= first_stop) for p in positions)


def copy_checkpoint(row, donor, checkpoint, layout) -> int:
    """Sets ``row.cache`` to what its own prefill would hold at
    ``checkpoint``'s position ``p`` (``checkpoint_to_copy``'s): attention
    columns ``[row.prefilled, p)`` from ``donor``'s cache, every other state
    from the checkpoint. Where ``p`` is one of ``row``'s stops it takes its
    own checkpoint there, as its prefill would. Returns the tokens copied."""
    begin, end = row.prefilled, checkpoint.position
    for j, index in enumerate(layout.stateful):
        mine, theirs = row.cache.layers[index], donor.cache.layers[index]
        parts, state = layout.parts[index], checkpoint.states[j]
        if ATTENTION in parts:  # update copies (into the row's buffer): the views need no copy
            mine.update(theirs.keys[:, :, begin:end], theirs.values[:, :, begin:end])
        if RECURRENT in parts:  # a snapshot keeps a hybrid layer's recurrent part alone
            recurrent = state.recurrent if isinstance(state, _C.HybridState) else state
            write_recurrent(mine, recurrent, layout.templates[j].slots)
    row.prefilled = row.length = end
    if end in row.stops:
        row.checkpoints.append(row.snapshot(row.cache, end))
    return end - begin


def waits_for(row, other, minimum: int = SHARE_MIN_TOKENS) -> bool:
    """Whether ``row`` should wait for ``other``'s forward and copy from it:
    ``other`` will compute at least ``minimum`` tokens of ``row``'s prompt
    that ``row`` does not hold (and may copy them: ``shares_with``)."""
    if not shares_with(row, other):
        return False
    shared = common_prefix(row, other, row.prompt_tokens - 1)
    return shared - max(row.prefilled, held_tokens(other)) >= minimum


_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


def length_dependent_rope(config) -> str | None:
    """The rotary embedding's type when its frequencies follow the longest
    position in the forward ("dynamic", "longrope"): rows decoding or
    prefilling together would change each other's. None otherwise."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(parameters, dict):
        return None
    if "rope_type" in parameters or "type" in parameters:
        candidates = [parameters]
    else:  # per layer type (gemma3: full_attention, sliding_attention)
        candidates = [value for value in parameters.values() if isinstance(value, dict)]
    for candidate in candidates:
        kind = candidate.get("rope_type", candidate.get("type"))
        if kind in _LENGTH_DEPENDENT_ROPE:
            return kind
    return None


class LogitsShapeError(RuntimeError):
    """The forward gave other logits than ``logits_to_keep`` asked for."""


def logits_to_keep_kind(parameters) -> str | None:
    """How the forward takes ``logits_to_keep``: "tensor" (positions, as
    transformers' models declare it), "int" (a count from the end), or None."""
    parameter = parameters.get("logits_to_keep")
    if parameter is None:
        return None
    return "tensor" if "Tensor" in str(parameter.annotation) else "int"


def ask_for_logits(kwargs: dict, positions: list[int], width: int, keep_kind, device) -> list[int]:
    """Sets the forward's ``logits_to_keep`` in ``kwargs`` as it takes one
    (``keep_kind``: ``logits_to_keep_kind``'s): ``positions`` of the forward's
    ``width`` new tokens where it takes positions, else every position.
    Returns the positions its logits will stand for, in order."""
    if keep_kind == "tensor":
        kwargs["logits_to_keep"] = torch.tensor(positions, device=device)
        return list(positions)
    if keep_kind == "int":
        kwargs["logits_to_keep"] = 0
    return list(range(width))


def check_logits(outputs, sequences: int, keep: list[int], what: str) -> None:
    """Raises ``LogitsShapeError`` unless the forward gave ``sequences`` rows of
    logits, one per position of ``keep`` (``ask_for_logits``'s); ``what``
    names the forward's input in the message."""
    if tuple(outputs.logits.shape[:2]) != (sequences, len(keep)):
        raise LogitsShapeError(
            f"the model's forward gave logits of shape {tuple(outputs.logits.shape)} for "
            f"{what} and logits_to_keep={keep}: not one per position asked"
        )


def prefill_together(model, rows, new_cache, cache_argument: str, keep_kind: str | None):
    """One forward over the rest of every row's prompt (module docstring);
    appends each row's new keys and values to its cache and returns each
    row's float32 logits ``[1, vocab]`` at its last prompt token.
    ``keep_kind``: ``logits_to_keep_kind`` of the forward."""
    device = rows[0].ids.device
    past = [row.prefilled for row in rows]
    new = [row.prompt_tokens - row.prefilled for row in rows]
    longest, width = max(past), max(new)
    ids = torch.empty((len(rows), width), dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), longest + width), dtype=torch.long, device=device)
    positions = torch.empty((len(rows), width), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, : new[i]] = row.ids[0, past[i] : row.prompt_tokens]
        ids[i, new[i] :] = row.ids[0, row.prompt_tokens - 1]  # any token: nothing reads it
        mask[i, longest - past[i] : longest + new[i]] = 1
        positions[i, : new[i]] = torch.arange(past[i], past[i] + new[i], device=device)
        # The padding repeats the last position: never one past the model's
        # table of learned positions, however long the other rows are.
        positions[i, new[i] :] = past[i] + new[i] - 1
    cache = new_cache()
    for index, layer in enumerate(cache.layers):
        sources = [row.cache.layers[index] for row in rows]
        template = next((s for s in sources if getattr(s, "keys", None) is not None), None)
        if template is None or not longest:  # a layer with no cache, or no past
            continue
        shape = (len(rows), template.keys.shape[1], longest, template.keys.shape[3])
        keys = template.keys.new_zeros(shape)
        values = template.values.new_zeros(
            (len(rows), template.values.shape[1], longest, template.values.shape[3])
        )
        for i, source in enumerate(sources):
            if past[i]:
                keys[i, :, longest - past[i] :] = source.keys[0, :, : past[i]]
                values[i, :, longest - past[i] :] = source.values[0, :, : past[i]]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    kwargs = {cache_argument: cache, "attention_mask": mask, "position_ids": positions}
    # Only the logits at each row's last prompt token: the positions where
    # the forward takes them, else every position.
    keep = ask_for_logits(kwargs, sorted(set(n - 1 for n in new)), width, keep_kind, device)
    outputs = model(input_ids=ids, use_cache=True, return_dict=True, **kwargs)
    check_logits(outputs, len(rows), keep, f"{len(rows)} prompts")
    logits = []
    for i, row in enumerate(rows):
        for index, layer in enumerate(cache.layers):
            if getattr(layer, "keys", None) is None:  # a layer with no cache
                continue
            row.cache.layers[index].update(  # copies: the views need no copy first
                layer.keys[i : i + 1, :, longest : longest + new[i]],
                layer.values[i : i + 1, :, longest : longest + new[i]],
            )
        row.prefilled = row.length = row.prompt_tokens
        column = keep.index(new[i] - 1)
        logits.append(outputs.logits[i : i + 1, column].to(copy=True, dtype=torch.float32))
    return logits
