"""The OpenAI-facing router for prefill/decode disaggregation (no torch, no vLLM)."""
