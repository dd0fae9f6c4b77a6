"""Prompts that begin alike prefilled as one sequence, their head once.

Several new conversations that start together send one system prompt (a
server's clients at once, an agent framework's parallel calls). Side by side
(``prompts.prefill_together``) each row computes that beginning again: four
chat first turns of 35 tokens that share 17 run 140 tokens, padding counted,
where 17 and four tails of 18 would do (on a CPU a prefill costs its tokens).
Here, where every row holds as many tokens and the prompts go on alike past
them (``shared_head``), the rows run in a batch of one:

- **the head once**, first: a key or value depends only on the token ids
  before it and their positions, so the head's are what each row's own
  forward would give (``copy_prefix`` relies on the same); then each row's
  own tail;
- **the first row's past** as the forward's past: the rows' pasts hold the
  same tokens;
- **a mask that keeps each row to itself**: a head token sees the past and
  the head before it; a tail token the past, the head and its own tail
  before it. Positions are each token's own.

Rows that share no head stay side by side: one sequence would save their
padding only to attend across every row's past (``_Loop._as_one``). So do rows of
different share scopes (``prompts.shares_with``: sharing off, or another
namespace): one tenant's prompt never starts from another's past, nor
reuses its head's keys, nor runs faster because another sent the same.

The mask goes to the model as a 4D additive one, which transformers passes
to the attention unchanged: only the attention implementations that take it
("sdpa", "eager") prefill this way (``takes_4d_mask``); the others
(FlashAttention's, flex), ALiBi (whose biases Falcon builds from the 2D
mask) and GPT-Neo's local layers (a window of indices, where a tail's index
is not its position), keep ``prefill_together``'s 2D padding mask.
"""

from __future__ import annotations

import torch

from .prompts import ask_for_logits, check_logits, common_prefix, shares_with

# The attention implementations that read a 4D additive mask as given.
FOUR_D_MASK_ATTENTION = ("sdpa", "eager")


def takes_4d_mask(model) -> bool:
    """Whether ``model``'s attention takes a 4D additive mask as given, and
    places keys by ``position_ids`` (not ALiBi's biases from a 2D mask, nor
    GPT-Neo's local window of indices)."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    # Attention that places keys by their index, not their position: ALiBi's
    # biases (Falcon builds them from a 2D mask), GPT-Neo's local layers (a
    # window of indices, masked on top of the mask given).
    if getattr(config, "alibi", False) or "local" in getattr(config, "attention_layers", ()):
        return False
    return getattr(config, "_attn_implementation", None) in FOUR_D_MASK_ATTENTION


def shared_head(rows) -> int:
    """How many tokens past what they hold every row's prompt shares with the
    others', where all hold as many and share one scope (0 otherwise): never
    a row's last prompt token, whose logits it needs."""
    held = rows[0].prefilled
    if len(rows) < 2 or any(
        row.prefilled != held or not shares_with(rows[0], row) for row in rows[1:]
    ):
        return 0
    limit = min(row.prompt_tokens for row in rows) - 1
    common = min(common_prefix(rows[0], row, limit) for row in rows[1:])
    return max(0, common - held)


def sequence_tokens(rows) -> int:
    """The tokens ``prefill_as_one`` runs for ``rows``."""
    new = sum(row.prompt_tokens - row.prefilled for row in rows)
    return new - (len(rows) - 1) * shared_head(rows)


def prefill_as_one(model, rows, new_cache, cache_argument: str, keep_kind: str | None):
    """One forward over the rest of every row's prompt (module docstring),
    for rows that share a head (``shared_head`` > 0); appends each row's new
    keys and values to its cache and returns each row's float32 logits
    ``[1, vocab]`` at its last prompt token. ``keep_kind``:
    ``prompts.logits_to_keep_kind`` of the forward."""
    head = shared_head(rows)
    if not head:
        raise ValueError("prefill_as_one takes rows whose prompts share a head")
    device = rows[0].ids.device
    past = rows[0].prefilled  # every row's
    # The new tokens: the head, then each row's tail; ``tail_at`` where each starts.
    ids, positions = [rows[0].ids[0, past : past + head]], [torch.arange(past, past + head)]
    tail_at, total = [], head
    for row in rows:
        begin = past + head
        ids.append(row.ids[0, begin : row.prompt_tokens])
        positions.append(torch.arange(begin, row.prompt_tokens))
        tail_at.append(total)
        total += row.prompt_tokens - begin
    ids = torch.cat(ids)[None]
    positions = torch.cat(positions)[None].to(device)
    # Columns: the past, then the new tokens in the order above.
    allowed = torch.zeros((total, past + total), dtype=torch.bool)
    allowed[:, : past + head] = True  # everyone sees the past and the head...
    allowed[:head, past : past + head] = torch.ones(head, head, dtype=torch.bool).tril()
    for at, row in zip(tail_at, rows, strict=True):  # ...and a tail itself, causally
        length = row.prompt_tokens - past - head
        own = past + at
        allowed[at : at + length, own : own + length] = torch.ones(
            length, length, dtype=torch.bool
        ).tril()
    dtype = model.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    cache = new_cache()
    for index, layer in enumerate(cache.layers):
        source = rows[0].cache.layers[index]
        if not past or getattr(source, "keys", None) is None:  # no past, or no cache
            continue
        keys, values = source.keys[:, :, :past], source.values[:, :, :past]
        layer.lazy_initialization(keys, values)  # its update concatenates: a new tensor
        layer.keys, layer.values = keys, values
    kwargs = {
        cache_argument: cache,
        "attention_mask": mask[None, None].to(device),
        "position_ids": positions,
    }
    tails = zip(tail_at, rows, strict=True)
    lasts = [at + row.prompt_tokens - past - head - 1 for at, row in tails]
    keep = ask_for_logits(kwargs, lasts, total, keep_kind, device)
    outputs = model(input_ids=ids.to(device), use_cache=True, return_dict=True, **kwargs)
    check_logits(outputs, 1, keep, "one sequence")
    logits = []
    for at, last, row in zip(tail_at, lasts, rows, strict=True):
        own = past + at
        for index, layer in enumerate(cache.layers):
            if getattr(layer, "keys", None) is None:  # a layer with no cache
                continue
            mine = row.cache.layers[index]
            for begin, end in ((past, past + head), (own, own + row.prompt_tokens - past - head)):
                if end > begin:  # update copies: the views need no copy first
                    mine.update(layer.keys[:, :, begin:end], layer.values[:, :, begin:end])
        row.prefilled = row.length = row.prompt_tokens
        logits.append(outputs.logits[:, keep.index(last)].to(copy=True, dtype=torch.float32))
    return logits
