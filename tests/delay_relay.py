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


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader -> writer, each chunk `delay` after it arrived (order kept)."""
    queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

    async def read() -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                queue.put_nowait((time.monotonic() + delay, data or None))
                if not data:
                    return
        except (ConnectionError, OSError):
            queue.put_nowait((0.0, None))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
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


async def _serve_one(target: tuple[str, int], delay: float, c_reader: asyncio.StreamReader,
                     c_writer: asyncio.StreamWriter) -> None:
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
    up = asyncio.ensure_future(_pipe(c_reader, t_writer, delay))
    down = asyncio.ensure_future(_pipe(t_reader, c_writer, delay))
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


async def serve(pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]], delay: float) -> None:
    servers = []
    for listen, target in pairs:
        servers.append(await asyncio.start_server(
            lambda r, w, t=target: _serve_one(t, delay, r, w), listen[0], listen[1], reuse_address=True))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


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
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "ab") if log else subprocess.DEVNULL,  # noqa: SIM115
                         start_new_session=True, text=True)
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
