"""Why a transfer cannot be handed over to the engine: the receiver's transfer errors.

Apart from receiver/transfer_table.py so that the table and the record of where each transfer stands
(receiver/transfer_states.py) raise the same ones.
"""

from __future__ import annotations

from kvferry.common.errors import UnavailableError


class TransferError(UnavailableError, RuntimeError):
    """A transfer cannot be handed over; the message says why and which key bounds it."""


class TransferTimeout(TransferError):
    """The KV did not arrive within pd_kv_ready_timeout."""


class TransferGone(TransferError):
    """Already read, aborted, or its lease expired."""
