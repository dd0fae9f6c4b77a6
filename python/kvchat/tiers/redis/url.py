"""What a Redis URL may show in a message, and what of it never may.

The client's own errors can quote a URL's parts, passwords included, so kvchat
never shows them: it shows the URL as ``redact_url`` writes it, and scrubs every
credential (as written and percent-decoded) from the texts it logs.
"""

from __future__ import annotations

import re

EXPECTED = "redis://[[user]:password@]host[:port][/db] (or rediss://, unix://)"


def location(url: str) -> str | None:
    """What of ``url`` (after its scheme) a message may show, credentials as
    ``***``; None where it does not parse cleanly, since then any piece of it
    may be part of a password (one holding '#', '/' or '?' not percent-encoded,
    a ':' typed for '@')."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if "#" in url or "@" in parts.path or "@" in parts.query:
        return None
    if parts.scheme == "unix":
        return parts.path or None
    host = parts.hostname
    if not host or not re.fullmatch(r"(/\d*)?", parts.path):
        return None
    location = f"[{host}]" if ":" in host else host
    if port is not None:
        location += f":{port}"
    credentials = "***@" if "@" in parts.netloc else ""
    return f"{credentials}{location}{parts.path}{'?***' if parts.query else ''}"


def redact_url(url) -> str:
    """The URL as a message may show it: scheme, host, port and database,
    never a credential; its scheme alone where it does not parse cleanly."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    scheme, sep, _ = url.partition("://")
    if not sep:  # a host name alone may show; "user:password@host" may not
        return url if re.fullmatch(r"[A-Za-z0-9.-]*", url) else "***"
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return "***"
    return f"{scheme}://{location(url) or '***'}"


def secrets_of(url: str) -> list[str]:
    """What of ``url`` no message may show (its credentials, as written and decoded)."""
    from urllib.parse import parse_qsl, unquote

    found = []
    rest = url.partition("://")[2] or url
    if "@" in rest:
        userinfo = rest.rsplit("@", 1)[0]
        found += [userinfo, *userinfo.split(":")]
    for name, value in parse_qsl(rest.partition("?")[2], keep_blank_values=True):
        if name.lower() in ("password", "username", "user", "pass"):
            found.append(value)
    found += [unquote(f) for f in found]
    # Shorter ones would garble the message (and are no secret).
    return sorted({f for f in found if len(f) >= 3}, key=len, reverse=True)


def scrub(text: str, secrets_: list[str]) -> str:
    """``text`` with every one of ``secrets_`` replaced by ``***``."""
    for secret in secrets_:
        text = text.replace(secret, "***")
    return text
