"""What a turn's ``generate`` arguments ask for, decided once per turn and
before the session is touched.

transformers validates generate arguments only inside ``generate``, after
kvchat would have leased (or created) the session and built its cache; a typo
there must not cost a session its cache. So the arguments are resolved here
the way ``generate`` resolves them, with its own helpers, and a bad one raises
before anything else happens.

Some generation modes cannot continue from a pre-filled cache exactly:
assisted decoding (transformers' candidate generator re-reads the cache
wrongly), ``use_cache=False``, a ``cache_implementation`` of the caller's, and
the prompt's hidden states or attentions (a reused turn computes them only for
the uncached tail). Those turns run as plain ``generate``, with no cache
passed, so they give exactly what ``model.generate`` gives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers.generation import GenerationMode

from . import _C

logger = logging.getLogger("kvchat")

# generate's own keyword parameters that are not generation-config fields.
_GENERATE_PARAMETERS = (
    "generation_config",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "trust_remote_code",
    "tokenizer",
    "assistant_tokenizer",
)
_UNSUPPORTED = _C.ReuseReason.unsupported_generation
# Modes that decode one sequence token by token from the cache: what kvchat reuses for.
_REUSABLE_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


@dataclass(frozen=True)
class GenerateArgs:
    kwargs: dict  # what to pass to generate (never past_key_values)
    max_new_tokens: int  # the most tokens this turn can generate, for context checks
    plain_reason: _C.ReuseReason | None  # why the turn runs as plain generate; None: it reuses
    why: str = ""  # the detail behind plain_reason, for the log
    # kvchat's own: sampling draws from a generator seeded with it, so a
    # seeded reply is the same alone or batched with others (and the same as
    # plain generate after torch.manual_seed(seed)).
    seed: int | None = None


def _check_max_new_tokens(value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_new_tokens must be a positive int, got {value!r}")
    return value


def check_seed(value):
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**64
    ):
        raise ValueError(f"seed must be an int in [-2**63, 2**64), got {value!r}")
    return value


def _int_or_zero(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _new_tokens_by_length(model, kwargs: dict, config, prompt_tokens: int) -> int:
    """The tokens generate makes without max_new_tokens, as it decides: up to
    ``max_length`` when someone set one (the call, its generation_config or the
    model's); otherwise ``max_length`` more than the prompt (its default, 20),
    within the model's positions."""
    given = kwargs.get("generation_config")
    has_default = (
        kwargs.get("max_length") is None
        and (given is None or given.max_length is None)
        and getattr(model.generation_config, "max_length", None) is None
    )
    max_length = _int_or_zero(config.max_length)
    if not has_default:
        return max(max_length - prompt_tokens, 0)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    total = prompt_tokens + max_length
    if isinstance(positions, int):
        total = min(total, positions)
    return max(total - prompt_tokens, 0)


def resolve_generate_args(model, kwargs: dict, prompt_tokens: int) -> GenerateArgs:
    """Resolves ``kwargs`` as ``model.generate`` would; raises ``ValueError`` for
    what it would refuse (a misspelled argument, a bad value)."""
    kwargs = dict(kwargs)
    _check_max_new_tokens(kwargs.get("max_new_tokens"))
    seed = check_seed(kwargs.pop("seed", None))
    # "dynamic" is what kvchat's cache is: asking for it changes nothing.
    if kwargs.get("cache_implementation") == "dynamic":
        del kwargs["cache_implementation"]
    mode_kwargs = {k: kwargs[k] for k in _GENERATE_PARAMETERS if k in kwargs}
    config_kwargs = {k: v for k, v in kwargs.items() if k not in mode_kwargs}
    prepare = getattr(model, "_prepare_generation_config", None)
    validate = getattr(model, "_validate_model_kwargs", None)
    if prepare is None or validate is None:  # a transformers without these helpers
        config, model_kwargs = model.generation_config, {}
    else:
        config, model_kwargs = prepare(mode_kwargs.get("generation_config"), **config_kwargs)
        validate(dict(model_kwargs))

    max_new = _check_max_new_tokens(config.max_new_tokens)
    if max_new is None:
        max_new = _new_tokens_by_length(model, kwargs, config, prompt_tokens)
    assistant = mode_kwargs.get("assistant_model")
    mode = config.get_generation_mode(assistant)

    reason, why = None, ""
    if mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE) or (
        (config.num_return_sequences or 1) > 1
    ):
        # Beam search and several sequences reorder and widen the cache.
        reason = _C.ReuseReason.multiple_sequences
        why = f"{mode.value}, {config.num_return_sequences} sequences"
    elif mode not in _REUSABLE_MODES or mode_kwargs.get("custom_generate") is not None:
        reason, why = _UNSUPPORTED, f"generation mode {mode.value}"
    elif config.use_cache is False:
        reason, why = _UNSUPPORTED, "use_cache=False"
    elif config.cache_implementation is not None:
        reason, why = _UNSUPPORTED, f"cache_implementation={config.cache_implementation!r}"
    elif config.output_hidden_states or config.output_attentions:
        reason, why = _UNSUPPORTED, "the prompt's hidden states or attentions"
    return GenerateArgs(kwargs, max_new, reason, why, seed)
