"""Store URLs as they may be shown: a password in ``scheme://user:password@host`` never reaches a log
line, an error or a repr (stdlib only, so config, engine and launcher share one rule)."""

from __future__ import annotations

import re

HIDDEN = "***"
_HOSTS = re.compile(r"[^/?#@\s,]+:\d+(,[^/?#@\s,]+:\d+)*")


def userinfo_split(url: str) -> tuple[str, str, str] | None:
    """(scheme://, userinfo, @rest) of a URL with credentials, else None.

    The userinfo ends at the last '@' followed by host:port[,host:port...], so a password holding
    '@', ':', '/' or '?' (not percent-encoded) is still hidden whole; with no such '@', at the last
    '@' of all (hiding too much rather than too little)."""
    scheme, sep, rest = url.partition("://")
    ats = [i for i, c in enumerate(rest) if c == "@"]
    if not sep or not ats:
        return None
    at = next((i for i in reversed(ats) if _HOSTS.fullmatch(re.split(r"[/?#]", rest[i + 1:], maxsplit=1)[0])),
              ats[-1])
    return scheme + sep, rest[:at], rest[at:]


def redact_url(url: str | None) -> str:
    """`url` with the password of its userinfo replaced by ***; the user name stays (it is no secret)."""
    if not url:
        return url or ""
    parts = userinfo_split(url)
    if parts is None:
        return url
    prefix, userinfo, rest = parts
    user, colon, _ = userinfo.partition(":")
    return f"{prefix}{user}:{HIDDEN}{rest}" if colon else url
