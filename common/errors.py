"""kvferry's one exception root, and the few kinds callers tell apart.

Every error kvferry raises on purpose derives from `KVFerryError` and one kind below, so a caller
catches kvferry's failures (`except KVFerryError`) without catching bugs. Each concrete error also
keeps the builtin base it had before (ValueError, RuntimeError, ...), so existing handlers and
users' code that catch those still work.
"""

from __future__ import annotations


class KVFerryError(Exception):
    """Anything kvferry raises on purpose; the message names the fix."""


class ConfigurationError(KVFerryError):
    """A setting, flag or secret that cannot be used: fix it and start again."""


class BadDataError(KVFerryError):
    """Data that crossed a process boundary (a message, a stored chunk, a peer's or an engine's
    answer, a client's parameters) and failed its checks: a miss or a refusal, never trusted."""


class UnavailableError(KVFerryError):
    """A peer, store, engine or resource that did not answer, refused, timed out or is full."""
