"""Typed counter records that flatten to the ``name -> number`` dicts stats travel as.

One base for every layer (sender, receiver, engine tiers), so each counter set is a dataclass and
none writes its own flattening.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any


class Counters:
    """Subclass as a ``@dataclass``; ``prefix`` names its series (``remote_`` → ``remote_errors``)."""

    prefix = ""

    def as_dict(self) -> dict[str, Any]:
        return {f"{self.prefix}{k}": v for k, v in asdict(self).items()}  # type: ignore[call-overload]  # subclasses are dataclasses
