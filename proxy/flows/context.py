"""What the endpoint handlers share: options, metrics, the router, the transfer bookkeeping and
the body reader (built once by app.Proxy)."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.proxy.flows.kv_transfers import Transfers
from kvferry.proxy.metrics import ProxyMetrics
from kvferry.proxy.multiproc.admin_log import Peers
from kvferry.proxy.openai.body import BodyReader
from kvferry.proxy.options import ProxyOptions
from kvferry.proxy.routing.router import Router
from kvferry.proxy.routing.tokens import PromptTokens


@dataclass(frozen=True)
class Context:
    opts: ProxyOptions
    metrics: ProxyMetrics
    router: Router
    transfers: Transfers
    bodies: BodyReader
    tokens: PromptTokens
    peers: Peers | None = None  # --workers N: admin changes shared with the other workers
