"""The engine: one thread runs every forward of a manager's model, decoding
every active conversation in one batched step (see ``loop``, ``batch``,
``row`` and docs/ARCHITECTURE.md)."""

from .loop import Engine
from .row import DecodeRow, decoding_method, seeded, seeded_generator, stop_strings_as_criteria

__all__ = [
    "DecodeRow",
    "Engine",
    "decoding_method",
    "seeded",
    "seeded_generator",
    "stop_strings_as_criteria",
]
