"""HTTP for the proxy: the one server clients reach (the front door), a request and its answer,
SSE framing, the JSON codec and request limits. The client that reaches the engines is
common/http/client.py."""
