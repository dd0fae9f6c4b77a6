"""The Redis tier, in parts: ``tier`` (the front), ``chunks`` (the codec),
``writer``, ``reader``, ``copies`` (held marks and tombstones), ``routes``
(``kvchat serve``'s conversation map), ``responses`` (its stored responses),
``keys``, ``connection``, ``scripts`` and ``url``. Importing it needs no Redis
client; constructing one does."""

from .tier import WRITE_POLICIES, RedisTier
from .url import redact_url

__all__ = ["WRITE_POLICIES", "RedisTier", "redact_url"]
