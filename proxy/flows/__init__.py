"""One client request from start to end: completions and chat, streamed or not, the prefill leg,
the decode leg, and failover to another decoder."""
