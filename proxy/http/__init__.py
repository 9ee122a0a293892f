"""HTTP for the proxy: the one server clients reach, the one client that reaches the engines,
SSE framing and request limits."""
