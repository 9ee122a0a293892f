"""Why a send failed: the sender's exceptions and the bounded metric label for each."""

from __future__ import annotations

import concurrent.futures

from kvferry.buffer import peering
from kvferry.common.errors import BadDataError


class SendError(peering.PeerError):
    """A transfer failed; the message names the receiver and the key that bounds the failed step."""

    code = "send_failed"


class HandshakeFailed(SendError):
    code = "handshake"


class FingerprintMismatch(HandshakeFailed, peering.FingerprintError):
    code = "fingerprint"


class AllocFailed(SendError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # buffer_full | too_large | timeout | ...


class LeaseExpired(SendError):
    code = "lease_expired"


class WriteFailed(SendError):
    code = "write"


class TransferDropped(SendError):
    """The receiver dropped the transfer (nobody will read it: its request's client left)."""

    code = "aborted"


# Receivers' refusal codes and the sender's own failure kinds: a metric label never carries a
# string a peer made up.
FAILURE_REASONS = frozenset({"send_failed", "handshake", "fingerprint", "buffer_full", "too_large", "timeout",
                             "stale_epoch", "aborted", "duplicate", "bad_message", "lease_expired", "write",
                             "asleep"})


def failure_reason(e: BaseException) -> str:
    """A bounded label for why a send failed."""
    if isinstance(e, concurrent.futures.CancelledError):
        return "cancelled"
    code = getattr(e, "code", "send_failed")
    return code if code in FAILURE_REASONS else "other"


class ChunkError(BadDataError, ValueError):
    """Chunks handed to `send` that it cannot send (outside registered memory, keys that do not match)."""


class ReceiverRestarted(Exception):
    """The receiver answered with another epoch than we handshook with: handshake again, once."""
