"""Prefiller side of a KV transfer: handshake, alloc request, NIXL WRITE, completion."""
