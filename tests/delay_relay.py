"""A userspace TCP relay that adds a fixed delay in each direction: link latency where the kernel
has no `netem` qdisc.

    python tests/delay_relay.py --delay-ms 1 10.77.5.101:7100=10.77.5.11:7100 [MORE ...]

Each `LISTEN=TARGET` pair listens on LISTEN and, for every accepted connection, opens one to
TARGET; every chunk read on one side is written to the other `delay` after it was read, in order,
so a request/response exchange over the relay takes 2 x delay more (a round trip over a link with
that one-way latency). Bandwidth is not limited. EOF is forwarded (after the data before it) as a
half close; a reset on either side closes both. Prints `ready` once every listener is bound.
`start_relay()` runs it as a child process for tests and benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

CHUNK = 1 << 16


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


class Link:
    """One listener's settings and counters: the delay (changeable while it runs) and, over its
    connections, how many there were and how many request/response exchanges they carried (a
    chunk toward the client after one toward the target: one round trip)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.connections = 0
        self.exchanges = 0

    def reset(self) -> None:
        self.connections = self.exchanges = 0


class _Conn:
    def __init__(self, link: Link) -> None:
        self.link, self.last = link, ""

    def saw(self, direction: str) -> None:
        if direction == "down" and self.last == "up":
            self.link.exchanges += 1
        self.last = direction


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link, conn: _Conn | None = None,
                direction: str = "up") -> None:
    """Copy reader -> writer, each chunk `link.delay` after it arrived (order kept)."""
    queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

    async def read() -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                if data and conn is not None:
                    conn.saw(direction)
                queue.put_nowait((time.monotonic() + link.delay, data or None))
                if not data:
                    return
        except (ConnectionError, OSError):
            queue.put_nowait((0.0, None))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # a sleep (pacing): the relay's job: the link's delay
            if data is None:
                with contextlib.suppress(OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()


async def _serve_one(target: tuple[str, int], link: Link, c_reader: asyncio.StreamReader,
                     c_writer: asyncio.StreamWriter) -> None:
    link.connections += 1
    try:
        t_reader, t_writer = await asyncio.wait_for(asyncio.open_connection(*target), 10)
    except (TimeoutError, OSError):
        c_writer.close()
        return
    for w in (c_writer, t_writer):
        sock = w.get_extra_info("socket")
        if sock is not None:
            import socket
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = _Conn(link)
    up = asyncio.ensure_future(_pipe(c_reader, t_writer, link, conn, "up"))
    down = asyncio.ensure_future(_pipe(t_reader, c_writer, link, conn, "down"))
    try:
        done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
        if any(t.exception() for t in done if not t.cancelled()):
            for t in pending:
                t.cancel()
        else:
            await asyncio.gather(*pending, return_exceptions=True)
    except (ConnectionError, OSError):
        pass
    finally:
        for w in (c_writer, t_writer):
            with contextlib.suppress(Exception):
                w.close()


async def _start(pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]],
                 links: Sequence[Link]) -> list[asyncio.Server]:
    return [await asyncio.start_server(lambda r, w, t=target, k=link: _serve_one(t, k, r, w), listen[0], listen[1],
                                       reuse_address=True)
            for (listen, target), link in zip(pairs, links, strict=True)]


async def serve(pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]], delay: float) -> None:
    servers = await _start(pairs, [Link(delay) for _ in pairs])
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


class RelayThread:
    """The relay inside this process (a thread with its own event loop): `links[i]` is pair i's
    delay and counters, readable and settable while it runs."""

    def __init__(self, delay_ms: float, pairs: Sequence[tuple[str, int, str, int]]) -> None:
        import threading
        self.links = [Link(delay_ms / 1000) for _ in pairs]
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        spec = [((lh, lp), (th, tp)) for lh, lp, th, tp in pairs]

        def body() -> None:
            asyncio.set_event_loop(self._loop)
            self._servers = self._loop.run_until_complete(_start(spec, self.links))
            started.set()
            self._loop.run_forever()
        self._thread = threading.Thread(target=body, name="delay-relay", daemon=True)
        self._thread.start()
        if not started.wait(15):
            raise RuntimeError("delay relay did not start")

    def set_delay(self, delay_ms: float) -> None:
        for link in self.links:
            link.delay = delay_ms / 1000

    def reset(self) -> None:
        for link in self.links:
            link.reset()

    def stop(self) -> None:
        async def close() -> None:
            for s in self._servers:
                s.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()
        asyncio.run_coroutine_threadsafe(close(), self._loop)
        self._thread.join(10)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delay-ms", type=float, required=True, help="added latency, each direction")
    ap.add_argument("pairs", nargs="+", metavar="LISTEN=TARGET", help="host:port=host:port")
    args = ap.parse_args(argv)
    pairs = []
    for p in args.pairs:
        listen, sep, target = p.partition("=")
        if not sep:
            ap.error(f"{p}: expected LISTEN_HOST:PORT=TARGET_HOST:PORT")
        pairs.append((_split(listen), _split(target)))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(pairs, args.delay_ms / 1000))


def start_relay(delay_ms: float, pairs: Sequence[tuple[str, int, str, int]], log: Path | None = None,
                timeout: float = 15) -> subprocess.Popen:
    """A relay child process (its own session) for (listen_host, port, target_host, port) pairs,
    returned once it listens."""
    argv = [sys.executable, __file__, "--delay-ms", str(delay_ms),
            *(f"{lh}:{lp}={th}:{tp}" for lh, lp, th, tp in pairs)]
    err = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, start_new_session=True, text=True)
    assert p.stdout is not None
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    if not sel.select(timeout) or p.stdout.readline().strip() != "ready":
        p.kill()
        p.wait(5)
        raise RuntimeError(f"delay relay did not start: {argv}")
    return p


if __name__ == "__main__":
    main()
