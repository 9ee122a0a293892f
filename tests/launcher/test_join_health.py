"""launcher/join.py's health checks on the library's one HTTP client (common/http/client.py): a
member is registered while its /health answers 200 (its checks on one kept connection) and
withdrawn after FAILS_TO_WITHDRAW failed ones; a check that gets no answer fails within its bound."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvferry.common.discovery import sources as disc
from kvferry.common.netutil import free_port
from kvferry.common.wire import messages as m
from kvferry.launcher import join
from kvferry.launcher.join import JoinedInstance, Registrar
from tests.polling import until_async


class Health:
    """A raw HTTP server whose /health answers `status` (None: reads the request, answers nothing)."""

    def __init__(self) -> None:
        self.status: int | None = 200
        self.connections = self.checks = 0
        self.port = free_port()

    async def _on(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await r.readuntil(b"\r\n\r\n"):
                assert head.startswith(b"GET /health HTTP/1.1\r\n"), head
                self.checks += 1
                if self.status is None:
                    await r.read()  # silent until the client gives up
                    return
                w.write(b"HTTP/1.1 %d X\r\nContent-Length: 2\r\n\r\nok" % self.status)
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._on, "127.0.0.1", self.port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def test_join_registers_while_health_answers_200_and_withdraws_after_failed_checks(tmp_path: Path) -> None:
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"instances": []}))
    target = disc.parse_target(f"file://{path}")

    def listed() -> list[str]:
        return [d["instance_id"] for d in json.loads(path.read_text())["instances"]]

    async def main() -> None:
        engine = Health()
        await engine.start()
        rec = m.InstanceRecord(instance_id="p-h", role="prefiller", model="stub", url=engine.url,
                               fingerprint=disc.fingerprint("stub"))
        reg, stop = Registrar(target, None, ttl=3, interval=0.05), asyncio.Event()
        keep = asyncio.ensure_future(reg.keep(JoinedInstance(rec, f"{engine.url}/health"), stop))
        try:
            await until_async(lambda: listed() == ["p-h"] and engine.checks >= 4, 60, "p-h registered, checked on")
            assert engine.connections == 1  # every check on the one kept connection
            engine.status = 503
            await until_async(lambda: listed() == [], 60, "p-h withdrawn after failed checks")
            assert reg.registered["p-h"] is False
            engine.status = 200
            await until_async(lambda: listed() == ["p-h"], 60, "p-h registered again")
        finally:
            stop.set()
            await asyncio.wait_for(keep, 10)
            engine.server.close()
        assert listed() == []  # stopping withdraws it
    asyncio.run(main())


def test_join_health_check_without_an_answer_fails_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(join, "HEALTH_TIMEOUT_S", 0.3)

    async def main() -> None:
        from kvferry.common.http.client import Pool
        engine = Health()
        engine.status = None
        await engine.start()
        pool = Pool(1, 1.0, 1.0, 10.0, {})
        reg = Registrar(disc.parse_target("file:///nonexistent/instances.json"), None, ttl=3)
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert await reg._health(pool, f"{engine.url}/health") is False
            assert loop.time() - t0 < 2.0
            assert await reg._health(pool, f"http://127.0.0.1:{free_port()}/health") is False  # nobody there
        finally:
            await pool.close()
            engine.server.close()
    asyncio.run(main())
