"""The lm:// wire framing shared by kvferry-server and LMClient: one place for the sizes both ends bound."""

from __future__ import annotations

from kvferry.common.wire import messages as m

LEN_BYTES = 4  # every frame: a 4-byte big-endian length, then that many bytes of a msgpack header
MAX_HEADER = m.MAX_FRAME_BYTES
MAX_AUTH_HEADER = 1024  # an AuthAnswer is ~120 bytes: an unauthenticated peer gets no big buffer
NONCE_BYTES = 32
CLIENT_PURPOSE, SERVER_PURPOSE = "lm-auth-client", "lm-auth-server"
DEFAULT_MAX_CHUNK = 256 << 20  # the server's default --max-frame: no reply is larger unless told so


def frame(msg: m.Msg) -> bytes:
    """A message as it goes on the wire: its length, then its msgpack bytes."""
    body = m.encode(msg)
    return len(body).to_bytes(LEN_BYTES, "big") + body
