"""What a request's head must say of its framing and its Host (RFC 9112), judged by the front door
(http/front_door.py) before anything of the request is answered or its body read.

**Transfer-Encoding.** Every field line counts: the lines of a list field are one list, in order,
each line's comma-separated values in turn (RFC 9110 §5.3), empty elements ignored. The server
decodes one coding, chunked, so:

- exactly `chunked`: the body is chunked;
- `chunked` last and once, after others (`gzip, chunked`, or `gzip` and `chunked` on two lines):
  501, a coding the server does not implement (RFC 9112 §6.1). llhttp would read the chunks and
  hand on a gzip body as if it were plain;
- anything else (a coding without `chunked` last, `chunked` twice or with parameters): 400, as
  the body's length cannot then be known (RFC 9112 §6.3); and Transfer-Encoding on an HTTP/1.0
  request, whose framing RFC 9112 §6.1 calls faulty.

Each of these answers closes the connection, nothing of the body read. Framing llhttp refuses
itself (Transfer-Encoding beside Content-Length, two Content-Lengths, an empty coding) is a 400
before the head is whole.

**Host.** 400 for an HTTP/1.1 request without one, for any request with more than one (the
server and a proxy in front of it could each read another), and for a value that is not
`host[:port]` with an RFC 3986 host: a name of unreserved, percent-encoded and sub-delimiter
characters, or a bracketed IP literal (RFC 9112 §3.2). An empty value is valid (a target without
an authority). The admin API's keyless rule (common/http/guard.py) then reads the one Host.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_HOST = re.compile(r"(?:\[[A-Za-z0-9._~!$&'()*+,;=:-]+\]|[A-Za-z0-9._~!$&'()*+,;=%-]*)(?::[0-9]*)?")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")  # a name's % starts a percent-encoded octet
_SEEN: set[str] = set()  # Host values found valid: a client sends the same one on every request
_SEEN_MAX = 256
_HOST_FIX = "send one Host header naming the server as the client called it, e.g. 'Host: localhost:9000'"


def coding_refusal(lines: Sequence[str], http10: bool) -> tuple[int, str] | None:
    """The status and message a request with these Transfer-Encoding lines is answered, or None:
    its body is chunked."""
    codings = [c for line in lines for c in (part.strip(" \t").lower() for part in line.split(",")) if c]
    if http10:
        return 400, ("Transfer-Encoding on an HTTP/1.0 request (RFC 9112 §6.1: its framing is faulty): send "
                     "HTTP/1.1, or a Content-Length body")
    if codings == ["chunked"]:
        return None
    if codings and codings[-1] == "chunked" and "chunked" not in codings[:-1]:
        return 501, (f"Transfer-Encoding {', '.join(codings[:-1])} is not implemented: this server decodes "
                     "chunked only; send the body without other codings (Transfer-Encoding: chunked, or "
                     "Content-Length)")
    return 400, (f"Transfer-Encoding {', '.join(codings)!r} does not frame a body: chunked must be the final "
                 "coding, once (RFC 9112 §6.3); send Transfer-Encoding: chunked or Content-Length")


def host_refusal(values: Sequence[str], http10: bool) -> str | None:
    """Why a request with these Host values is answered 400, or None."""
    if len(values) == 1:
        value = values[0]
        if value in _SEEN:
            return None
        if _HOST.fullmatch(value.strip(" \t")) is None or ("%" in value and _BAD_ESCAPE.search(value)):
            return f"Host {value!r} is not host[:port] (RFC 9112 §3.2): {_HOST_FIX}"
        if len(_SEEN) < _SEEN_MAX:
            _SEEN.add(value)
        return None
    if not values:
        return None if http10 else f"an HTTP/1.1 request needs a Host header (RFC 9112 §3.2): {_HOST_FIX}"
    return f"{len(values)} Host headers (RFC 9112 §3.2 allows one): {_HOST_FIX}"
