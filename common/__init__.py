"""Config, wire messages, hashing, logging and metrics shared by every layer (stdlib + msgspec only)."""
