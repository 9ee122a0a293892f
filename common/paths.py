"""Where kvferry keeps what it builds once per machine (stdlib only)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVFERRY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvferry``, else ``~/.cache/kvferry``."""
    root = os.environ.get("KVFERRY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvferry")
    return Path(root)
