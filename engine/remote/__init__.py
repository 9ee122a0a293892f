"""Remote stores (redis://, redis-sentinel://, lm://): backends, wire format and the lm:// protocol."""
