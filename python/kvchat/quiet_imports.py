"""transformers imports torchao, when it is installed, as it first imports its
model classes (``transformers.modeling_utils`` imports its quantizers); on a
CPU machine torchao then logs that its CUDA kernels do not load and that
triton is missing, and torch that torchao registers enums it no longer needs
to: noise at every start, about a package kvchat does not use. Only those
loggers, only while that import runs."""

from __future__ import annotations

import contextlib
import logging

NOISY_ON_IMPORT = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_imports():
    """Within it, ``NOISY_ON_IMPORT``'s loggers log errors only."""
    loggers = [logging.getLogger(name) for name in NOISY_ON_IMPORT]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def import_model_classes() -> None:
    """Imports transformers' model machinery quietly (once; later imports are free)."""
    with quiet_imports():
        import transformers.modeling_utils  # noqa: F401
