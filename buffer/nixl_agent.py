"""One way to create kvferry's NIXL agents: UCX, no progress thread.

NIXL's UCX progress thread busy-polls a whole core even when idle (measured here: ~99 %); on a
CPU host that core is the model's. kvferry drives progress itself, from the thread that already
waits on a transfer (the sender's completion polling, the receiver's notification polling), with
short sleeps, so an idle sender or receiver uses almost no CPU.
"""

from __future__ import annotations

from typing import Any


class NixlUnavailable(RuntimeError):
    """nixl is not installed or has no UCX plugin."""


def make_agent(name: str) -> Any:
    """A `nixl_agent` named `name` with the UCX backend and no progress thread.

    The agent is not thread-safe (sync mode NONE): callers use it from one thread only.
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise NixlUnavailable(f"nixl is not installed ({e}): pip install nixl") from None
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise NixlUnavailable("nixl has no UCX plugin here: reinstall nixl (pip install --force-reinstall nixl)")
    return agent


def mem_type(device: str) -> str:
    """NIXL's memory type for a torch device string."""
    return "VRAM" if device.startswith("cuda") else "DRAM"


def device_id(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0
