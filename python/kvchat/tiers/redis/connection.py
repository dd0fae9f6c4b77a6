"""The Redis client of one tier, its scripts, and whether the store is believed
reachable: after a failure the tier rests for ``retry_after`` seconds (every
call would wait out its timeout meanwhile), then tries again."""

from __future__ import annotations

import logging
import time

from . import scripts
from .url import EXPECTED, location, redact_url, scrub, secrets_of

logger = logging.getLogger("kvchat")


class Connection:
    """url: ``redis://host:port/db`` (``rediss://``, ``unix://``); every call
    is bounded by ``timeout`` seconds. Messages show the URL redacted, and the
    client's error texts with every credential scrubbed."""

    @staticmethod
    def check_url(url) -> None:
        """Whether the client is installed and ``url`` is a Redis URL (checked
        before the tier's other arguments, so a wrong URL is what a message
        names first)."""
        try:
            import redis  # noqa: F401  (the optional dependency, needed only here)
        except ImportError:
            raise ImportError(
                "the Redis store needs the redis client: pip install 'kvchat[redis]'"
            ) from None
        if not isinstance(url, str) or "://" not in url:
            raise ValueError(
                f"store must be a redis:// URL, as {EXPECTED}, got {redact_url(url)!r}"
            )
        if location(url) is None:  # never the client's own message: it may quote a password
            raise ValueError(
                f"store URL {redact_url(url)!r} is not a Redis URL: expected {EXPECTED}, "
                "with any '@', ':', '/', '?' or '#' in a user name or password percent-encoded"
            )

    def __init__(self, url: str, timeout: float, retry_after: float):
        self.check_url(url)
        import redis

        try:
            self.client = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        except ValueError as error:  # its text may quote the URL's parts: never shown
            raise ValueError(
                f"store URL {redact_url(url)!r} is not a Redis URL the client takes "
                f"({type(error).__name__}): expected {EXPECTED}"
            ) from None
        self.errors = (redis.RedisError, OSError)
        self.watch_error = redis.WatchError
        register = self.client.register_script
        self.publish = register(scripts.PUBLISH)
        self.delete = register(scripts.DELETE)
        self.route = register(scripts.ROUTE)
        self.take = register(scripts.TAKE)
        self.take_session = register(scripts.TAKE_SESSION)
        self.refresh = register(scripts.REFRESH)
        self.release = register(scripts.RELEASE)
        self.put_response = register(scripts.PUT_RESPONSE)
        self.delete_response = register(scripts.DELETE_RESPONSE)
        self.response_totals = register(scripts.RESPONSE_TOTALS)
        self.url = redact_url(url)  # never the password: the URL as messages may show it
        self._secrets = secrets_of(url)  # scrubbed from the client's error texts
        self.call_timeout, self.retry_after = timeout, retry_after
        self.down_until = 0.0

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def failed(self, what: str, error: Exception) -> None:
        """``what`` failed with ``error``: rest, and say so (scrubbed)."""
        self.down_until = time.monotonic() + self.retry_after
        logger.warning(
            "kvchat: Redis store %s failed (%s: %s); going on without it for %g s",
            what,
            type(error).__name__,
            scrub(str(error), self._secrets),
            self.retry_after,
        )
