"""What the proxy asks an engine about its health and load, on the library's one HTTP client
(common/http/client.py): `GET /health`, and the few series of vLLM's `/metrics` routing reads
(requests running and waiting, KV cache usage), parsed with prometheus-client's parser.

Each call is bounded by the `seconds` it is given and never raises: a failure is an answer (an
unhealthy instance, or a load not known). The router acts on the answers (routing/router.py).
"""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from kvferry.common.http.client import Broken, Pool, Unreachable

MAX_HEALTH_BODY = 1 << 16  # vLLM's /health answers an empty body
MAX_METRICS_PAGE = 1 << 24  # an engine's /metrics page: vLLM's is tens of KB, per engine and LoRA

RUNNING, WAITING, KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
_WANTED = (RUNNING.encode(), WAITING.encode(), KV_USAGE.encode())


async def check(pool: Pool, url: str, seconds: float) -> tuple[bool, str]:
    """GET /health: (healthy, why). vLLM answers 200 while its EngineCore lives and 503 once it is
    dead (then its API server exits, and the port refuses connections)."""
    try:
        async with asyncio.timeout(seconds):
            r = await pool.request("GET", url, "/health")
            try:
                await r.read(MAX_HEALTH_BODY)
            finally:
                r.release()
    except TimeoutError:
        return False, f"/health did not answer within {seconds:g}s"
    except (Unreachable, Broken) as e:
        return False, f"/health failed ({type(e).__name__}: {e})"
    return r.status == 200, f"/health answered {r.status}"


async def engine_series(pool: Pool, url: str, seconds: float) -> dict[str, list[float]] | None:
    """The values of the series routing reads from the engine's /metrics, by name (one value per
    engine of a data-parallel instance); None when the page cannot be had."""
    try:
        async with asyncio.timeout(seconds):
            r = await pool.request("GET", url, "/metrics")
            try:
                page = await r.read(MAX_METRICS_PAGE)
            finally:
                r.release()
    except (TimeoutError, Unreachable, Broken):
        return None
    return parse_series(page) if r.status == 200 else None


def parse_series(page: bytes) -> dict[str, list[float]] | None:
    """parse_series(a /metrics page): the values of the series routing reads, by name; None when
    the page is not Prometheus' text format."""
    # Only the lines routing reads go to the parser: the whole page would cost far more to parse.
    lines = [ln for ln in page.split(b"\n") if ln.startswith(_WANTED)]
    found: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(b"\n".join(lines).decode("utf-8", "replace") + "\n"):
            for s in family.samples:
                found.setdefault(s.name, []).append(float(s.value))
    except (ValueError, TypeError, IndexError):  # not the exposition format: nothing trusted from it
        return None
    return found


def load_of(series: dict[str, list[float]] | None) -> tuple[int | None, float | None]:
    """(running + waiting requests, KV cache usage 0..1) from engine_series(); None for what is
    missing or out of range."""
    if series is None:
        return None, None
    counts = series.get(RUNNING, []) + series.get(WAITING, [])
    if any(not 0 <= v < 1e9 for v in counts):
        return None, None
    return (round(sum(counts)) if counts else None), usage_of(series)


def usage_of(series: dict[str, list[float]] | None) -> float | None:
    """The KV cache usage (0..1; the last engine's of a data-parallel instance), or None."""
    usage = (series or {}).get(KV_USAGE)
    if not usage or not 0.0 <= usage[-1] <= 1.0:
        return None
    return usage[-1]
