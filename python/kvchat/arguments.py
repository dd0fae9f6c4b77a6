"""SessionManager's arguments, each checked once, with a message that names
the argument and the value: the constructor's as one ``ManagerOptions``, the
storage tier chosen from its three exclusive arguments, and the checks every
call shares (a session id, a path, a bool)."""

from __future__ import annotations

import os
import reprlib
import sys
from dataclasses import dataclass
from pathlib import Path

from . import _C
from .tiers.base import Tier
from .tiers.disk import Spill
from .tiers.shared import SharedTier
from .units import parse_bytes

# The core's sizes are signed 64-bit.
MAX_INT = 2**63 - 1
MATCH_MODES = ("tokens", "text")
BUSY_MODES = ("wait", "error")
OVERFLOW_MODES = ("error", "truncate")
CHECKPOINT_PLACEMENTS = {
    "last": _C.CheckpointPlacement.last_message,
    "every": _C.CheckpointPlacement.every_message,
}


class ContextLengthError(ValueError):
    """The prompt plus ``max_new_tokens`` does not fit ``max_context_length``
    (or a history to settle leaves no room for a next turn). A ``ValueError``,
    so callers that catch those still do; ``kvchat serve`` answers it with
    ``context_length_exceeded``."""


def positive_int(value, name: str, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
        raise ValueError(f"{name} must be a positive int, got {value!r} (at most 2**63 - 1)")
    return value


_MAX_FLOAT = sys.float_info.max


def check_seconds(value, name: str, allow_none: bool = True) -> float | None:
    """A wait in seconds: a non-negative, finite number, or None (no limit)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        what = "a number of seconds or None" if allow_none else "a number of seconds"
        raise TypeError(f"{name} must be {what}, got {value!r}")
    # An int past a float's range (10**400) is no finite float either.
    if not 0 <= value < float("inf") or value > _MAX_FLOAT:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_session_id(session_id) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise TypeError(f"session_id must be a non-empty string, got {session_id!r}")
    try:
        session_id.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"session_id must be valid Unicode text, got {session_id!r} ({error.reason})"
        ) from None
    return session_id


def check_path(path) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"path must be a non-empty str or os.PathLike, got {path!r}")
    return Path(path)


def check_model(model) -> None:
    """A transformers decoder-only LM: kvchat keeps one cache per conversation
    that the next prompt extends, which an encoder-decoder model has no place for."""
    if not (hasattr(model, "generate") and hasattr(model, "config")):
        raise TypeError(
            f"model must be a transformers causal LM with generate() and config, "
            f"got {type(model).__name__}"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(
            f"model must be a decoder-only causal LM (AutoModelForCausalLM), got "
            f"{type(model).__name__}, an encoder-decoder model: kvchat reuses the cache of a "
            f"prompt that each turn extends, which an encoder-decoder model does not keep"
        )


# What kvchat calls on a tokenizer (a wrapper that forwards these will do).
_TOKENIZER_NEEDS = ("eos_token_id", "decode", "apply_chat_template")


def check_tokenizer(tokenizer) -> None:
    """None, or something that tokenizes as a transformers tokenizer does."""
    if tokenizer is None:
        return
    missing = [name for name in _TOKENIZER_NEEDS if not hasattr(tokenizer, name)]
    if missing or not callable(tokenizer):
        raise TypeError(
            f"tokenizer must be the model's transformers tokenizer "
            f"(AutoTokenizer.from_pretrained(...)) or None, got "
            f"{type(tokenizer).__name__} {reprlib.repr(tokenizer)}"
        )


def _one_of(value, name: str, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


@dataclass(frozen=True)
class ManagerOptions:
    """The constructor's arguments as the manager and the core use them
    (``SessionManager.__init__`` documents each)."""

    max_sessions: int
    max_cache_bytes: int  # 0: no bound
    max_context_length: int | None  # None: the model config's
    match: str
    max_checkpoints: int
    max_checkpoint_bytes: int  # 0: no bound
    placement: _C.CheckpointPlacement
    wait: bool  # busy="wait"
    truncate: bool  # overflow="truncate"
    min_shared_tokens: int  # 0: prefixes are not shared
    isolate_namespaces: bool
    settle: bool
    settle_delay: float  # seconds without a turn before a settle starts
    max_batch_size: int = 16  # conversations decoding in one step
    max_step_tokens: int = 256  # prompt tokens prefilled between two decode steps

    @classmethod
    def check(
        cls,
        *,
        max_sessions,
        max_cache_bytes,
        max_context_length,
        match,
        max_checkpoints,
        max_checkpoint_bytes,
        checkpoints,
        busy,
        overflow,
        share_prefixes,
        min_shared_tokens,
        isolate_namespaces,
        settle,
        settle_delay,
        max_batch_size=16,
        max_step_tokens=256,
    ) -> ManagerOptions:
        positive_int(max_sessions, "max_sessions")
        positive_int(max_batch_size, "max_batch_size")
        positive_int(max_step_tokens, "max_step_tokens")
        _one_of(overflow, "overflow", OVERFLOW_MODES)
        _one_of(busy, "busy", BUSY_MODES)
        _one_of(match, "match", MATCH_MODES)
        _one_of(checkpoints, "checkpoints", CHECKPOINT_PLACEMENTS)
        if (
            isinstance(max_checkpoints, bool)
            or not isinstance(max_checkpoints, int)
            or not 0 <= max_checkpoints <= MAX_INT
        ):
            raise ValueError(
                f"max_checkpoints must be an int >= 0 and below 2**63, got {max_checkpoints!r}"
            )
        check_bool(share_prefixes, "share_prefixes")
        check_bool(isolate_namespaces, "isolate_namespaces")
        check_bool(settle, "settle")
        check_seconds(settle_delay, "settle_delay", allow_none=False)
        positive_int(min_shared_tokens, "min_shared_tokens")
        return cls(
            max_sessions=max_sessions,
            max_cache_bytes=parse_bytes(max_cache_bytes) or 0,
            max_context_length=positive_int(
                max_context_length, "max_context_length", allow_none=True
            ),
            match=match,
            max_checkpoints=max_checkpoints,
            max_checkpoint_bytes=parse_bytes(max_checkpoint_bytes, "max_checkpoint_bytes") or 0,
            placement=CHECKPOINT_PLACEMENTS[checkpoints],
            wait=busy == "wait",
            truncate=overflow == "truncate",
            min_shared_tokens=min_shared_tokens if share_prefixes else 0,
            isolate_namespaces=isolate_namespaces,
            settle=settle,
            settle_delay=float(settle_delay),
            max_batch_size=max_batch_size,
            max_step_tokens=max_step_tokens,
        )

    def core(
        self, num_layers: int, keep_evicted: bool, markers, prefill_checkpoints: bool
    ) -> tuple[_C.ManagerLimits, _C.TurnSettings]:
        """The core's two option objects: these options, with what the model
        (its layer count, markers and whether it needs checkpoints) and the
        tier (whether it keeps evicted caches) add."""
        limits = _C.ManagerLimits(
            max_sessions=self.max_sessions,
            max_cache_bytes=self.max_cache_bytes,
            num_layers=num_layers,
            checkpoints=_C.CheckpointPolicy(self.max_checkpoints, self.max_checkpoint_bytes),
            min_shared_tokens=self.min_shared_tokens,
            keep_evicted=keep_evicted,
            isolate_namespaces=self.isolate_namespaces,
        )
        settings = _C.TurnSettings(
            markers=markers,
            prefill_checkpoints=prefill_checkpoints,
            placement=self.placement,
        )
        return limits, settings


RELOAD_REASONS = {r.name: r for r in (_C.ReuseReason.spill_reload, _C.ReuseReason.store_reload)}


def reload_reason(tier: Tier) -> _C.ReuseReason:
    """The core's reason for a turn that starts from ``tier``'s cache: its
    ``reload_reason``, "spill_reload" or "store_reload" (a name or the enum)."""
    reason = getattr(tier, "reload_reason", None)
    name = reason if isinstance(reason, str) else getattr(reason, "name", None)
    if name not in RELOAD_REASONS or not isinstance(reason, (str, _C.ReuseReason)):
        raise TypeError(
            f'tier: reload_reason must be "spill_reload" or "store_reload", got {reason!r} '
            f"on {type(tier).__name__}"
        )
    return RELOAD_REASONS[name]


def choose_tier(spill_dir, tier, store) -> Tier:
    """The one storage tier of ``spill_dir`` (disk), ``tier`` (any) and
    ``store`` (a Redis URL), or the tier that keeps nothing."""
    if tier is not None and not isinstance(tier, Tier):
        raise TypeError(f"tier must be a kvchat.Tier, got {type(tier).__name__}")
    shared_only = ("writes_turns", "turn_finished", "deleted_since", "remember_route")
    if tier is not None and not isinstance(tier, SharedTier):
        # The manager asks only a SharedTier these: on a plain Tier they would
        # be silently never called.
        claims = [n for n in shared_only if getattr(tier, n, None)]
        if tier.shared or claims:
            what = "shared=True" if tier.shared else claims[0]
            raise TypeError(
                f"tier: a tier with {what} must subclass kvchat.SharedTier (its routes "
                f"go in SharedTier.routes), got {type(tier).__name__}"
            )
    if tier is not None:
        reload_reason(tier)  # refused here, not at the turn that first reloads from it
    if tier is not None and spill_dir is not None:
        raise ValueError("give spill_dir or tier, not both (spill_dir is the disk tier)")
    if store is not None:
        if not isinstance(store, str):
            raise TypeError(f"store must be a redis:// URL string, got {store!r}")
        if tier is not None or spill_dir is not None:
            raise ValueError("give one of store, spill_dir or tier (one tier per manager)")
        from .tiers.redis import RedisTier  # the redis client is an optional dependency

        return RedisTier(store)
    if tier is None:
        return Spill(spill_dir) if spill_dir is not None else Tier()
    return tier
