"""The transformers side of kvchat: a model's cache layout as a value
(``ModelLayout``), the probes that read it, and the conversions between the
core's layer states and transformers' ``DynamicCache`` (``CacheBridge``).

Nothing outside this package imports transformers' cache classes; storage
(session files, tiers) takes a ``ModelLayout`` only.
"""

from .cache_bridge import CacheBridge
from .forward import ForwardArguments
from .layers import BufferedIndexedLayer, BufferedLayer
from .layout import ATTENTION, RECURRENT, SLIDING, LayerKind, LayerTemplate, ModelLayout, describe

__all__ = [
    "ATTENTION",
    "RECURRENT",
    "SLIDING",
    "BufferedIndexedLayer",
    "BufferedLayer",
    "CacheBridge",
    "ForwardArguments",
    "LayerKind",
    "LayerTemplate",
    "ModelLayout",
    "describe",
]
