"""vLLM KVConnectorBase_V1 adapter (scheduler side and worker side)."""
