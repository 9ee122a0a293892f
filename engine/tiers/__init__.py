"""Where chunks live outside vLLM's cache, one module per tier (cpu, disk, p2p, remote) behind tiers/base.py."""
