"""The KV engine: chunking, prefix hashes and storage tiers (pd, cpu, disk, remote, p2p)."""
