"""kvferry-server: the ``lm://`` remote cache (LMCache's ``lmcache_server``), chunks in host memory.

    kvferry-server HOST PORT [cpu] [--max-bytes GB] [--max-frame MB]

Protocol (TCP, every frame): a 4-byte big-endian length, that many bytes of a msgpack header
(:class:`~kvferry.common.messages.RemotePut` / ``RemoteGet`` / ``RemoteExists``, answered by
``RemoteReply`` or ``ErrorReply``), then, for a put or a found get, ``nbytes`` raw payload bytes.
Reads are exact (a frame may arrive a byte at a time); a frame once started must finish within
``--frame-timeout``. A header over 4 MiB, a payload over ``--max-frame``, or a header that does
not decode is answered with an error and the connection is closed (its stream can no longer be
trusted); other connections never notice. Chunks live in an LRU capped at ``--max-bytes``.

Every connection opens with the server's ``ServerHello``. With a cluster secret
(``--cluster-secret-file``, or KVFERRY_CLUSTER_SECRET / KVFERRY_CLUSTER_SECRET_FILE) it carries a
fresh nonce, and the client must answer within ``--frame-timeout`` with ``AuthAnswer`` (its own
nonce, and an HMAC of both nonces with the secret's ``lm-auth-client`` key); the server proves the
secret back with ``AuthOk`` (``lm-auth-server`` key, the nonces the other way round) and only then
reads requests. Anything else gets ``ErrorReply(code="unauthorized")`` and the connection is
closed before a request is read. This authenticates both ends; it does not encrypt or sign the
frames that follow (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvferry.common import messages as m
from kvferry.common import secret as csecret
from kvferry.common import zsock
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.secret import ClusterSecret
from kvferry.common.units import fmt_bytes

logger = get_logger(__name__)

LEN_BYTES = 4
MAX_HEADER = m.MAX_FRAME_BYTES
MAX_AUTH_HEADER = 1024  # an AuthAnswer is ~120 bytes: an unauthenticated peer gets no big buffer
NONCE_BYTES = 32
CLIENT_PURPOSE, SERVER_PURPOSE = "lm-auth-client", "lm-auth-server"
NEEDS_SECRET = ("this kvferry-server requires the cluster secret: set cluster_secret_file (or "
                "KVFERRY_CLUSTER_SECRET_FILE) on the client to the file the server's --cluster-secret-file names")
WRONG_SECRET = ("wrong cluster secret: the client's cluster_secret_file must hold the same secret as the "
                "server's --cluster-secret-file")


class ChunkLRU:
    """Chunk bytes by key, least recently used first out, at most `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data: OrderedDict[bytes, bytes | bytearray] = OrderedDict()
        self.used = 0
        self.evictions = 0

    def put(self, key: bytes, value: bytes | bytearray) -> bool:
        if len(value) > self.limit:
            return False
        old = self.data.pop(key, None)
        if old is not None:
            self.used -= len(old)
        while self.used + len(value) > self.limit:
            _, gone = self.data.popitem(last=False)
            self.used -= len(gone)
            self.evictions += 1
        self.data[key] = value
        self.used += len(value)
        return True

    def get(self, key: bytes) -> bytes | bytearray | None:
        value = self.data.get(key)
        if value is not None:
            self.data.move_to_end(key)
        return value


def frame(msg: m.Msg) -> bytes:
    body = m.encode(msg)
    return len(body).to_bytes(LEN_BYTES, "big") + body


class Unauthorized(Exception):
    """A peer that did not prove the cluster secret; the message names the fix."""


async def _read_frame(exact, limit: int) -> bytes:  # noqa: ANN001 - the side's exact-read coroutine
    n = int.from_bytes(await exact(LEN_BYTES), "big")
    if n > limit:
        raise m.MessageError("too_large", f"header of {n} bytes exceeds {limit}")
    return bytes(await exact(n))


class LMServer:
    def __init__(self, host: str, port: int, max_bytes: int, max_frame: int, frame_timeout: float = 30.0,
                 secret: ClusterSecret | None = None) -> None:
        self.host, self.port = host, port
        self.store = ChunkLRU(max_bytes)
        self.max_frame, self.frame_timeout = max_frame, frame_timeout
        self.secret = secret
        self.counters = {"connections": 0, "puts": 0, "gets": 0, "hits": 0, "rejected": 0, "unauthorized": 0}
        self._warn = RateLimitedLog(logger)
        self._lsock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((self.host, self.port))
        except OSError:
            s.close()
            raise
        s.listen(128)
        s.setblocking(False)
        self._lsock, self.port = s, s.getsockname()[1]

    async def serve_forever(self) -> None:
        assert self._lsock is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                conn, peer = await loop.sock_accept(self._lsock)
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                task = asyncio.create_task(self._handle(conn, peer))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            self._lsock.close()

    async def _exact(self, conn: socket.socket, n: int) -> bytearray:
        """Exactly `n` bytes, received straight into their final buffer (no stream-buffer copies)."""
        loop = asyncio.get_running_loop()
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = await loop.sock_recv_into(conn, view[got:])
            if not k:
                raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
            got += k
        return buf

    async def _handle(self, conn: socket.socket, peer: object) -> None:
        self.counters["connections"] += 1
        try:
            await self._greet(conn)
            while await self._one(conn):
                pass
        except Unauthorized as e:
            self.counters["unauthorized"] += 1
            await self._reject(conn, peer, "unauthorized", str(e))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away mid-frame: its business
        except m.MessageError as e:
            await self._reject(conn, peer, "bad_message", str(e))
        except TimeoutError:
            await self._reject(conn, peer, "timeout", f"a frame did not finish within {self.frame_timeout:.0f}s")
        except Exception as e:  # noqa: BLE001 - one connection's failure must not end the server
            logger.exception("kvferry-server: connection %s failed: %s", peer, e)
        finally:
            conn.close()

    async def _greet(self, conn: socket.socket) -> None:
        """Send the ServerHello; with a secret, have the client prove it (Unauthorized if not) and prove it back."""
        loop = asyncio.get_running_loop()
        nonce = os.urandom(NONCE_BYTES) if self.secret is not None else b""
        await loop.sock_sendall(conn, frame(m.ServerHello(auth=self.secret is not None, nonce=nonce)))
        if self.secret is None:
            return
        try:
            async with asyncio.timeout(self.frame_timeout):
                body = await _read_frame(lambda n: self._exact(conn, n), MAX_AUTH_HEADER)
        except TimeoutError:
            raise Unauthorized(f"no answer to the cluster-secret challenge within {self.frame_timeout:g}s; "
                               + NEEDS_SECRET) from None
        except (m.MessageError, asyncio.IncompleteReadError) as e:
            if isinstance(e, asyncio.IncompleteReadError) and not e.partial:
                raise  # gone before a word: nothing to answer
            raise Unauthorized(f"{e}; {NEEDS_SECRET}") from None
        try:
            answer = m.decode(body, expect=m.AuthAnswer)
        except m.MessageError as e:
            raise Unauthorized(f"{e}; {NEEDS_SECRET}" if e.kind != "version" else str(e)) from None
        if not self.secret.verify(CLIENT_PURPOSE, answer.mac, nonce, answer.nonce):
            raise Unauthorized(WRONG_SECRET)
        await loop.sock_sendall(conn, frame(m.AuthOk(mac=self.secret.mac(SERVER_PURPOSE, answer.nonce, nonce))))

    async def _reject(self, conn: socket.socket, peer: object, code: str, message: str) -> None:
        self.counters["rejected"] += 1
        self._warn.warning("kvferry-server: closing connection %s: %s: %s", peer, code, message)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(
                conn, frame(m.ErrorReply(code=code, message=message[:4000]))), 1.0)
        except (ConnectionError, TimeoutError):
            pass

    async def _one(self, conn: socket.socket) -> bool:
        """Serve one request; False when the client closed the connection between frames."""
        loop = asyncio.get_running_loop()
        try:
            head = await self._exact(conn, LEN_BYTES)  # idle between requests: no limit
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise
            return False
        n = int.from_bytes(head, "big")
        if n > MAX_HEADER:
            raise m.MessageError("too_large", f"header of {n} bytes exceeds {MAX_HEADER}")
        async with asyncio.timeout(self.frame_timeout):
            msg = m.decode(bytes(await self._exact(conn, n)), expect=(m.RemotePut, m.RemoteGet, m.RemoteExists))
            if isinstance(msg, m.RemotePut):
                if msg.nbytes > self.max_frame:
                    raise m.MessageError("too_large", f"payload of {msg.nbytes} bytes exceeds --max-frame "
                                                      f"{self.max_frame}")
                data = await self._exact(conn, msg.nbytes)
        if isinstance(msg, m.RemotePut):
            self.counters["puts"] += 1
            if self.store.put(msg.key, data):
                out = [frame(m.RemoteReply())]
            else:
                out = [frame(m.ErrorReply(code="too_large", message=f"a {msg.nbytes}-byte chunk is larger than "
                                          f"the server's memory limit {self.store.limit}"))]
        elif isinstance(msg, m.RemoteGet):
            self.counters["gets"] += 1
            value = self.store.get(msg.key)
            if value is None:
                out = [frame(m.RemoteReply(found=False))]
            else:
                self.counters["hits"] += 1
                out = [frame(m.RemoteReply(found=True, nbytes=len(value))), value]
        else:
            out = [frame(m.RemoteReply(found_keys=[k in self.store.data for k in msg.keys]))]
        for part in out:
            await loop.sock_sendall(conn, part)
        return True


class LMError(RuntimeError):
    """The lm:// server could not be reached, timed out, or refused the request."""


class LMClient:
    """A blocking client (one connection, reconnected on demand); every call bounded by `timeout`.
    With `secret` (the cluster secret) it proves it to the server, and wants the server to prove
    it back, on every new connection; a server that wants no secret is refused."""

    def __init__(self, host: str, port: int, timeout: float = 5.0, secret: ClusterSecret | None = None) -> None:
        self.host, self.port, self.timeout, self.secret = host, port, timeout, secret
        self._sock: socket.socket | None = None

    def _conn(self, deadline: float) -> socket.socket:
        if self._sock is None:
            try:
                self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            except OSError as e:
                raise LMError(f"lm://{self.host}:{self.port} unreachable: {e}") from None
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._handshake(deadline)
        return self._sock

    def _frame(self, deadline: float, limit: int = MAX_HEADER) -> m.Msg:
        self._sock.settimeout(max(0.01, deadline - time.monotonic()))
        n = int.from_bytes(self._exact(LEN_BYTES), "big")
        if n > limit:
            raise m.MessageError("too_large", f"reply header of {n} bytes")
        return m.decode(bytes(self._exact(n)))

    def _handshake(self, deadline: float) -> None:
        """The server's greeting and, when it asks, the cluster-secret proof both ways."""
        where = f"lm://{self.host}:{self.port}"
        try:
            hello = self._frame(deadline, MAX_AUTH_HEADER)
            if not isinstance(hello, m.ServerHello):
                raise LMError(f"{where} did not greet with a ServerHello (got {type(hello).__name__}): is it a "
                              "kvferry-server of this version?")
            if hello.auth and self.secret is None:
                raise LMError(f"{where} requires the cluster secret: set cluster_secret_file (or "
                              "KVFERRY_CLUSTER_SECRET_FILE) to the file its --cluster-secret-file names")
            if not hello.auth and self.secret is not None:
                raise LMError(f"{where} does not check the cluster secret, so it cannot be told from an impostor: "
                              "start kvferry-server with --cluster-secret-file (the same secret as this instance's "
                              "cluster_secret_file)")
            if not hello.auth:
                return
            if len(hello.nonce) < 16:
                raise LMError(f"{where} sent a challenge of {len(hello.nonce)} bytes: not a kvferry-server")
            mine = os.urandom(NONCE_BYTES)
            self._sock.sendall(frame(m.AuthAnswer(nonce=mine, mac=self.secret.mac(CLIENT_PURPOSE, hello.nonce,
                                                                                  mine))))
            ok = self._frame(deadline)
            if isinstance(ok, m.ErrorReply):
                raise LMError(f"{where} refused: {ok.code}: {ok.message}")
            if not isinstance(ok, m.AuthOk) or not self.secret.verify(SERVER_PURPOSE, ok.mac, mine, hello.nonce):
                raise LMError(f"{where} could not prove the cluster secret: it holds another one (or is not the "
                              "server you meant); give both sides the same secret")
        except TimeoutError:
            self.close()
            raise LMError(f"{where}: no greeting within {self.timeout:g}s: is it a kvferry-server of this "
                          "version, and not overloaded?") from None
        except (OSError, m.MessageError) as e:
            self.close()
            raise LMError(f"{where}: handshake failed: {type(e).__name__}: {e}") from None
        except LMError:
            self.close()
            raise

    def _exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("server closed the connection")
            got += k
        return buf

    def _calls(self, calls: Sequence[tuple[m.Msg, Sequence[bytes | memoryview]]]
               ) -> list[tuple[m.RemoteReply, memoryview | None]]:
        """Send every request, then read every reply (one round trip); bounded by `timeout`."""
        deadline = time.monotonic() + self.timeout
        out: list[tuple[m.Msg, memoryview | None]] = []
        s = self._conn(deadline)
        try:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            for msg, payload in calls:
                s.sendall(frame(msg))
                for part in payload:  # sent as they are: no joined copy of a large chunk
                    s.sendall(part)
            for _ in calls:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                n = int.from_bytes(self._exact(LEN_BYTES), "big")
                if n > MAX_HEADER:
                    raise m.MessageError("too_large", f"reply header of {n} bytes")
                reply = m.decode(bytes(self._exact(n)), expect=(m.RemoteReply, m.ErrorReply))
                found = isinstance(reply, m.RemoteReply) and reply.found
                out.append((reply, memoryview(self._exact(reply.nbytes)) if found else None))
        except (OSError, m.MessageError) as e:
            self.close()
            raise LMError(f"lm://{self.host}:{self.port}: {type(e).__name__}: {e}") from None
        for reply, _ in out:
            if isinstance(reply, m.ErrorReply):
                raise LMError(f"lm://{self.host}:{self.port} refused: {reply.code}: {reply.message}")
        return out

    def _call(self, msg: m.Msg, *payload: bytes | memoryview) -> tuple[m.RemoteReply, memoryview | None]:
        return self._calls([(msg, payload)])[0]

    def put(self, key: bytes, *parts: bytes | memoryview) -> None:
        """Store the concatenation of `parts` under `key`."""
        self.put_many([(key, parts)])

    def put_many(self, items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> None:
        self._calls([(m.RemotePut(key=key, nbytes=sum(memoryview(p).nbytes for p in parts)), parts)
                     for key, parts in items])

    def get(self, key: bytes) -> memoryview | None:
        return self._call(m.RemoteGet(key=key))[1]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return list(self._call(m.RemoteExists(keys=list(keys)))[0].found_keys)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvferry-server", description="The lm:// remote KV cache server "
                                 "(LMCache's lmcache_server): chunks in host memory, LRU beyond --max-bytes.")
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("device", nargs="?", default="cpu", help="where chunks live: cpu (the only choice)")
    ap.add_argument("--max-bytes", type=float, default=4.0, help="GB (GiB) of chunks kept (default 4)")
    ap.add_argument("--max-frame", type=float, default=256, help="largest chunk accepted, MB (MiB) (default 256)")
    ap.add_argument("--frame-timeout", type=float, default=30.0,
                    help="seconds a started frame, or the answer to the cluster-secret challenge, may take")
    ap.add_argument("--cluster-secret-file", default=None,
                    help="clients must prove this cluster secret (their cluster_secret_file) before any request; "
                         "default: $KVFERRY_CLUSTER_SECRET or $KVFERRY_CLUSTER_SECRET_FILE")
    ap.add_argument("--require-cluster-secret", action="store_true",
                    help="refuse to listen beyond loopback without a cluster secret (otherwise: a warning)")
    args = ap.parse_args(argv)
    if args.device != "cpu":
        ap.error(f"device {args.device!r}: kvferry-server keeps chunks in host memory; use cpu")
    if not 0 < args.port < 65536:
        ap.error(f"port {args.port} is outside 1-65535")
    if args.max_bytes <= 0 or args.max_frame <= 0 or args.frame_timeout <= 0:
        ap.error("--max-bytes, --max-frame and --frame-timeout must be positive")
    try:
        secret = csecret.from_env(args.cluster_secret_file, "kvferry-server")
        zsock.check_exposure(args.host, "kvferry-server", zsock.Trust(secret, args.require_cluster_secret),
                             fix="Start it with --cluster-secret-file (the instances' cluster_secret_file)")
    except (csecret.SecretError, zsock.ExposureError) as e:
        print(f"kvferry-server: {e}", file=sys.stderr)
        return 2
    server = LMServer(args.host, args.port, int(args.max_bytes * (1 << 30)), int(args.max_frame * (1 << 20)),
                      args.frame_timeout, secret)

    async def run() -> None:
        try:
            await server.start()
        except OSError as e:
            raise SystemExit(f"kvferry-server: cannot listen on {args.host}:{args.port}: {e.strerror}") from None
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        logger.info("kvferry-server listening on %s:%d (memory limit %s, largest chunk %s; %s)", args.host,
                    server.port, fmt_bytes(server.store.limit), fmt_bytes(server.max_frame),
                    "clients must prove the cluster secret" if secret else "no cluster secret: any client")
        task = asyncio.create_task(server.serve_forever())
        await stop.wait()
        task.cancel()
        logger.info("kvferry-server stopped: %d chunks (%s) dropped", len(server.store.data),
                    fmt_bytes(server.store.used))

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
