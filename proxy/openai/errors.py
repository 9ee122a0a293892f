"""Errors the proxy answers to a client, in OpenAI's JSON shape (as vLLM writes it)."""

from __future__ import annotations

from kvferry.common.errors import KVFerryError
from kvferry.proxy.http.exchange import Response, error_body, json_response


class ProxyError(KVFerryError):
    """An error answered to the client as an OpenAI-style JSON body; its HTTP status says whose
    fault it is (4xx the request's, 5xx an instance's or the proxy's)."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error", body: bytes | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.body = status, message, kind, body
        self.param, self.headers = param, headers

    def response(self) -> Response:
        if self.body is not None:  # an upstream 4xx, passed through as the engine wrote it
            return Response(self.body, self.status)
        return json_response(error_body(self.status, self.message, self.kind, self.param), self.status,
                             self.headers)
