"""``kvchat serve``: an OpenAI-compatible chat server that keeps every
conversation's cache between turns. Needs the ``serve`` extra:
``pip install kvchat[serve]``."""

from __future__ import annotations

try:
    from .app import ServeConfig, create_app
except ImportError as error:  # fastapi, uvicorn or prometheus_client missing
    raise ImportError(
        f"kvchat serve needs the 'serve' extra ({error.name} is missing): "
        "pip install 'kvchat[serve]'"
    ) from error

__all__ = ["ServeConfig", "create_app"]
