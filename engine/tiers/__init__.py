"""Where chunks live outside vLLM's cache, one module per tier behind base.py's Tier interface.

Lookup order: cpu.py (host memory) -> disk.py (local files) -> p2p.py (another instance's CPU
tier) -> remote.py (a shared store: redis://, lm://). A chunk stored leaves vLLM for the CPU tier,
the disk tier and the remote store at once (engine/offload/planner.py decides which); one evicted
from the CPU tier stays wherever else it was stored.
"""
