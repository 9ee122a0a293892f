"""This machine as a host for instances, for `kvferry up` and `kvferry join` alike: the model to
serve, the GPUs it has, and the error either command stops with."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from kvferry.common.errors import ConfigurationError


class UpError(ConfigurationError, RuntimeError):
    """Cannot start the cluster; the message says why and what to do."""


def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def model_of(arg: str | None) -> tuple[str, str, int | None]:
    """(model path or name, served name, max model length) for --model (None: the tiny test model)."""
    if arg is None:
        from kvferry.launcher import tiny_model
        print("using the tiny test model (built on first use)", flush=True)
        return str(tiny_model.ensure()), "tiny", 8192
    model = arg
    looks_local = arg.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(arg))
    if looks_local and not Path(os.path.expanduser(arg)).exists():
        raise UpError(f"--model {arg}: no such path")
    if looks_local:
        model = str(Path(os.path.expanduser(arg)).resolve())
    return model, arg, None
