"""Decoder side of a KV transfer: init and alloc ports, reservations, arrival tracking."""
