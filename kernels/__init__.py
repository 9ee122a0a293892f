"""Copy KV between vLLM's paged cache and contiguous chunks (CPU torch, CUDA Triton)."""
