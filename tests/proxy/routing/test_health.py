"""proxy/routing/health.py: /health and the engine's /metrics read on the proxy's own HTTP client;
every failure is an answer (unhealthy, or load unknown), bounded by the time it is given."""

from __future__ import annotations

import asyncio

from kvferry.common.http.client import Pool
from kvferry.common.netutil import free_port
from kvferry.proxy.routing import health

PAGE = (b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        b"# TYPE vllm:num_requests_running gauge\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        b"# TYPE vllm:num_requests_waiting gauge\n"
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        b'vllm:num_requests_waiting_by_reason{engine="0",reason="x"} 50.0\n'
        b"# TYPE vllm:kv_cache_usage_perc gauge\n"
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        b'vllm:generation_tokens_total{engine="0"} 1e6\n')


async def _serve(answers: dict[str, tuple[int, bytes]]) -> tuple[asyncio.Server, str]:
    """A loopback HTTP/1.1 server answering each path with (status, body); "hang" paths never answer."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the pool closed its connection
            path = head.split(b" ", 2)[1].decode()
            status, body = answers[path]
            if status == 0:
                await asyncio.sleep(3600)  # a sleep (pacing): an engine that never answers
            writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
            await writer.drain()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _pool() -> Pool:
    return Pool(2, 1.0, 1.0, 5.0, {}, 5.0)


def test_health_answers_every_case_and_the_load_is_read_from_the_page() -> None:
    async def main() -> None:
        server, url = await _serve({"/health": (200, b""), "/metrics": (200, PAGE)})
        pool = _pool()
        try:
            assert await health.check(pool, url, 2.0) == (True, "/health answered 200")
            series = await health.engine_series(pool, url, 2.0)
            assert health.load_of(series) == (6, 0.25)  # both engines' running, plus waiting
        finally:
            await pool.close()
            server.close()
    asyncio.run(main())


def test_a_dead_a_refusing_and_a_silent_engine_are_bounded_answers() -> None:
    async def main() -> None:
        server, url = await _serve({"/health": (503, b"dead"), "/metrics": (0, b"")})
        pool = _pool()
        try:
            assert await health.check(pool, url, 2.0) == (False, "/health answered 503")
            loop = asyncio.get_running_loop()
            t = loop.time()
            assert await health.engine_series(pool, url, 0.3) is None  # never answers: bounded
            assert loop.time() - t < 2.0
            good, why = await health.check(pool, f"http://127.0.0.1:{free_port()}", 2.0)
            assert not good and "Unreachable" in why
        finally:
            await pool.close()
            server.close()
    asyncio.run(main())


def test_a_page_that_is_not_the_exposition_format_or_out_of_range_is_no_load() -> None:
    assert health.load_of(health.parse_series(b"vllm:num_requests_running{engine=0 x y\n")) == (None, None)
    assert health.load_of(health.parse_series(b"vllm:num_requests_running -1\n")) == (None, None)
    assert health.load_of(health.parse_series(b"vllm:num_requests_running 2\nvllm:kv_cache_usage_perc NaN\n")
                          ) == (2, None)
    assert health.load_of(health.parse_series(b"vllm:kv_cache_usage_perc 1.5\n")) == (None, None)
    assert health.load_of(health.parse_series(b"")) == (None, None)
