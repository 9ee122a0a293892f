"""Test support, for kvferry's own tests and users' tests of their deployments: a stub OpenAI
engine (`stub_engine`: the proxy's legs without a GPU), the stores tests start (`stores`), and
vLLM servers with the offload tiers (`vllm_servers`). No library module imports it
(tests/test_layout.py)."""
