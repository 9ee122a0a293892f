"""Where a request goes: the instances (`registry`), the router that picks a prefiller and a
decoder (`router`), the cache-aware policy (`cache`) over each instance's prefix index
(`prefix_index`) fed by vLLM's KV events (`kv_events`), and the tokens a text prompt will have
(`tokens`)."""
