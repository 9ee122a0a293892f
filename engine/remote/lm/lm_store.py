"""The ``lm://`` remote cache's server (LMCache's ``lmcache_server``), chunks in host memory; its
command line, ``kvferry-server``, is launcher/lm_server.py.

Protocol (TCP, every frame): a 4-byte big-endian length, that many bytes of a msgpack header
(:class:`~kvferry.common.wire.messages.RemotePut` / ``RemoteGet`` / ``RemoteExists``, answered by
``RemoteReply`` or ``ErrorReply``), then, for a put or a found get, ``nbytes`` raw payload bytes.
Reads are exact (a frame may arrive a byte at a time). A header over 4 MiB, a payload over
``--max-frame``, or a header that does not decode is answered with an error and the connection is
closed (its stream can no longer be trusted); other connections never notice. Chunks live in an
LRU capped at ``--max-bytes``.

Every resource a peer can hold has a limit (docs/lm_server.md): a connection waits at most
``--idle-timeout`` for its next frame; a frame, from the first byte of its length prefix to the
last of its payload, must finish within ``--frame-timeout``; a reply must be taken within
``--send-timeout``; at most ``--max-connections`` are open (the excess hears ``busy`` and is
closed at once); the bytes that frames being received hold, across all connections, stay under
``--max-inflight-bytes`` (a frame waits for room, within its frame timeout, before its buffer is
allocated). Accept errors (out of file descriptors above all) cost the connections that arrive
meanwhile, never the listener.

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

import asyncio
import errno
import os
import socket
from collections.abc import Sequence

from kvferry.common.fd_limits import fd_limit
from kvferry.common.log import RateLimitedLog, get_logger
from kvferry.common.netutil import tcp_listener
from kvferry.common.secret import ClusterSecret
from kvferry.common.units import fmt_bytes
from kvferry.common.wire import messages as m
from kvferry.engine.remote.lm.byte_budget import ByteBudget
from kvferry.engine.remote.lm.chunk_lru import ChunkLRU
from kvferry.engine.remote.lm.conn_cap import DEFAULT_MAX_CONNECTIONS, open_spare
from kvferry.engine.remote.lm.protocol import (
    CLIENT_PURPOSE,
    LEN_BYTES,
    MAX_AUTH_HEADER,
    MAX_HEADER,
    NONCE_BYTES,
    SERVER_PURPOSE,
    frame,
)

__all__ = ["ChunkLRU", "LMServer"]

logger = get_logger(__name__)

NEEDS_SECRET = ("this kvferry-server requires the cluster secret: set cluster_secret_file (or "
                "KVFERRY_CLUSTER_SECRET_FILE) on the client to the file the server's --cluster-secret-file names")
WRONG_SECRET = ("wrong cluster secret: the client's cluster_secret_file must hold the same secret as the "
                "server's --cluster-secret-file")
# Out of descriptors (or kernel memory): the listener stays good, the connection waiting is what fails.
RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_BACKOFF = (0.01, 1.0)  # first and longest pause after an accept error
SHED_BATCH = 64  # connections refused per accept error, so a flood cannot hold the loop


Request = m.RemotePut | m.RemoteGet | m.RemoteExists  # what a client may ask

class Unauthorized(Exception):
    """A peer that did not prove the cluster secret; the message names the fix."""


class Closing(Exception):
    """End this connection: with an ErrorReply of `code` first, or silently when `code` is None
    (the peer is idle, or is not reading what we send)."""

    def __init__(self, code: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _read_frame(exact, limit: int) -> bytes:  # noqa: ANN001 - the side's exact-read coroutine
    n = int.from_bytes(await exact(LEN_BYTES), "big")
    if n > limit:
        raise m.MessageError("too_large", f"header of {n} bytes exceeds {limit}")
    return bytes(await exact(n))


def _refuse_now(conn: socket.socket, code: str, message: str) -> None:
    """Tell a connection we will not serve why, if its buffer takes it at once, and close it."""
    try:
        conn.setblocking(False)
        conn.send(frame(m.ErrorReply(code=code, message=message)))
    except OSError:
        pass
    finally:
        conn.close()


class LMServer:
    """The lm:// store and its listener; every connection's memory, time and slot is bounded."""

    def __init__(self, host: str, port: int, max_bytes: int, max_frame: int, frame_timeout: float = 30.0,
                 secret: ClusterSecret | None = None, *, idle_timeout: float = 300.0, send_timeout: float = 30.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, max_inflight: int = 1 << 30) -> None:
        if max_inflight < max_frame:
            raise ValueError(f"--max-inflight-bytes ({fmt_bytes(max_inflight)}) is less than --max-frame "
                             f"({fmt_bytes(max_frame)}): a chunk of --max-frame could never be received; raise "
                             "--max-inflight-bytes or lower --max-frame")
        self.host, self.port = host, port
        self.store = ChunkLRU(max_bytes)
        self.max_frame, self.frame_timeout = max_frame, frame_timeout
        self.idle_timeout, self.send_timeout = idle_timeout, send_timeout
        self.max_connections = max_connections
        self.budget = ByteBudget(max_inflight)
        self.secret = secret
        self.active = 0
        self.counters = {"connections": 0, "puts": 0, "gets": 0, "hits": 0, "rejected": 0, "unauthorized": 0,
                         "refused_cap": 0, "refused_fd": 0, "accept_errors": 0, "idle_closed": 0,
                         "frame_timeouts": 0, "send_timeouts": 0, "busy": 0}
        # One limiter per kind of trouble, so a flood of one kind does not hide another.
        self._warn = RateLimitedLog(logger)
        self._cap_warn = RateLimitedLog(logger)
        self._accept_warn = RateLimitedLog(logger)
        self._lsock: socket.socket | None = None
        self._spare: int | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        s = tcp_listener(self.host, self.port)  # either family: "::1" and "::" work
        s.listen(128)
        s.setblocking(False)
        self._lsock, self.port = s, s.getsockname()[1]

    def stats(self) -> str:
        """One log line of counters and in-flight bytes (logged on SIGUSR1 and at exit)."""
        held = {"active": self.active, "inflight_bytes": self.budget.used, "peak_inflight_bytes": self.budget.peak,
                "waiting_for_room": self.budget.waiting, "chunks": len(self.store.data),
                "stored_bytes": self.store.used, "evictions": self.store.evictions}
        return " ".join(f"{k}={v}" for k, v in {**held, **self.counters}.items())

    async def serve_forever(self) -> None:
        """Accept until cancelled; no accept error ends the loop (out of descriptors: refuse and go on)."""
        assert self._lsock is not None
        loop = asyncio.get_running_loop()
        self._spare = open_spare()
        pause = ACCEPT_BACKOFF[0]
        try:
            while True:
                try:
                    conn, peer = await loop.sock_accept(self._lsock)
                except OSError as e:
                    self.counters["accept_errors"] += 1
                    self._accept_warn.warning(
                        "kvferry-server: cannot accept connections: %s (%d open, `ulimit -n` %d); refusing new ones "
                        "until that passes (%d refused so far): raise `ulimit -n` or lower --max-connections",
                        e.strerror or e, self.active, fd_limit(), self.counters["refused_fd"])
                    if not (e.errno in RESOURCE_ERRNOS and await self._out_of_descriptors()):
                        await asyncio.sleep(pause)
                        pause = min(2 * pause, ACCEPT_BACKOFF[1])
                    continue
                pause = ACCEPT_BACKOFF[0]
                self._admit(conn, peer)
        finally:
            self._lsock.close()
            if self._spare is not None:
                os.close(self._spare)
                self._spare = None

    async def _out_of_descriptors(self) -> bool:
        """After EMFILE: wait for a connection (Linux's accept() fails for want of a descriptor
        even when none is waiting, so retrying at once would spin), then serve it if descriptors
        were freed meanwhile, or refuse it; False if neither worked (the caller backs off)."""
        assert self._lsock is not None  # serving
        loop, fd = asyncio.get_running_loop(), self._lsock.fileno()
        arrived = loop.create_future()
        loop.add_reader(fd, lambda: None if arrived.done() else arrived.set_result(None))
        try:
            await asyncio.wait_for(arrived, ACCEPT_BACKOFF[1])
        except TimeoutError:
            return True  # nobody came: try a plain accept again
        finally:
            loop.remove_reader(fd)
        try:
            conn, peer = self._lsock.accept()
        except (BlockingIOError, InterruptedError):
            return True  # it went away before we took it
        except OSError as e:
            return e.errno in RESOURCE_ERRNOS and self._shed()
        self._admit(conn, peer)
        return True

    def _shed(self) -> bool:
        """Out of descriptors: spend the spare one to accept and close the waiting connections, so
        their clients hear 'busy' now instead of hanging in the backlog; True if any was."""
        if self._spare is None:
            self._spare = open_spare()
            return False
        os.close(self._spare)
        self._spare, shed = None, 0
        assert self._lsock is not None  # serving
        try:
            while shed < SHED_BATCH:
                conn, _ = self._lsock.accept()
                shed += 1
                self.counters["refused_fd"] += 1
                _refuse_now(conn, "busy", "kvferry-server is out of file descriptors; try again later (its "
                                          "operator: raise `ulimit -n` or lower --max-connections)")
        except OSError:
            pass  # the backlog is empty (EAGAIN), or the spare's slot was taken meanwhile
        finally:
            self._spare = open_spare()
        return shed > 0

    def _admit(self, conn: socket.socket, peer: object) -> None:
        if self.active >= self.max_connections:
            self.counters["refused_cap"] += 1
            self._cap_warn.warning("kvferry-server: refusing connection %s: %d connections open, the "
                                   "--max-connections limit (%d refused so far)", peer, self.active,
                                   self.counters["refused_cap"])
            _refuse_now(conn, "busy", f"kvferry-server has {self.active} connections open, its --max-connections; "
                                      "try again later (or raise its --max-connections)")
            return
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.active += 1
        task = asyncio.create_task(self._handle(conn, peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fill(self, conn: socket.socket, view: memoryview) -> None:
        """Receive exactly len(view) bytes into `view`."""
        loop = asyncio.get_running_loop()
        got, n = 0, len(view)
        while got < n:
            k = await loop.sock_recv_into(conn, view[got:])
            if not k:
                raise asyncio.IncompleteReadError(bytes(view[:got]), n)
            got += k

    async def _exact(self, conn: socket.socket, n: int) -> bytearray:
        """Exactly `n` bytes, received straight into their final buffer (no stream-buffer copies)."""
        buf = bytearray(n)
        await self._fill(conn, memoryview(buf))
        return buf

    async def _send(self, conn: socket.socket, parts: Sequence[bytes | bytearray]) -> None:
        """Send a reply within --send-timeout; a peer that does not read it loses its connection."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.send_timeout):
                for part in parts:
                    await loop.sock_sendall(conn, part)
        except TimeoutError:
            self.counters["send_timeouts"] += 1
            raise Closing(None, f"it did not take a reply within --send-timeout {self.send_timeout:g}s") from None

    async def _handle(self, conn: socket.socket, peer: object) -> None:
        self.counters["connections"] += 1
        try:
            await self._greet(conn)
            while await self._one(conn):
                pass
        except Unauthorized as e:
            self.counters["unauthorized"] += 1
            await self._reject(conn, peer, "unauthorized", str(e))
        except Closing as e:
            if e.code is None:
                logger.debug("kvferry-server: closing connection %s: %s", peer, e)
            else:
                await self._reject(conn, peer, e.code, str(e))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away mid-frame: its business
        except m.MessageError as e:
            await self._reject(conn, peer, "bad_message", str(e))
        except Exception as e:  # noqa: BLE001 - one connection's failure must not end the server
            logger.exception("kvferry-server: connection %s failed: %s", peer, e)
        finally:
            conn.close()
            self.active -= 1

    async def _greet(self, conn: socket.socket) -> None:
        """Send the ServerHello; with a secret, have the client prove it (Unauthorized if not) and prove it back."""
        nonce = os.urandom(NONCE_BYTES) if self.secret is not None else b""
        await self._send(conn, [frame(m.ServerHello(auth=self.secret is not None, nonce=nonce))])
        if self.secret is None:
            return
        try:
            # The whole answer, prefix included, within the frame timeout; at most 1 KiB is ever allocated.
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
        await self._send(conn, [frame(m.AuthOk(mac=self.secret.mac(SERVER_PURPOSE, answer.nonce, nonce)))])

    async def _reject(self, conn: socket.socket, peer: object, code: str, message: str) -> None:
        self.counters["rejected"] += 1
        self._warn.warning("kvferry-server: closing connection %s: %s: %s", peer, code, message)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(
                conn, frame(m.ErrorReply(code=code, message=message[:4000]))), 1.0)
        except OSError:  # gone, reset, or not reading (TimeoutError): the connection closes all the same
            pass

    async def _next_byte(self, conn: socket.socket, head: bytearray) -> bool:
        """Wait, up to --idle-timeout, for the first byte of the next frame; False if the client closed."""
        try:
            async with asyncio.timeout(self.idle_timeout):
                got = await asyncio.get_running_loop().sock_recv_into(conn, memoryview(head)[:1])
        except TimeoutError:
            self.counters["idle_closed"] += 1
            raise Closing(None, f"idle for --idle-timeout {self.idle_timeout:g}s") from None
        return got == 1

    async def _receive(self, conn: socket.socket, head: bytearray) -> tuple[Request, bytearray | None]:
        """The rest of a frame whose first byte is in `head`: its header, and a put's payload with
        its bytes reserved in the budget (the caller releases them). Closing on a timeout."""
        waiting = False  # for room in the budget, not for the peer's bytes
        try:
            async with asyncio.timeout(self.frame_timeout):  # from the first byte: a partial prefix is a frame
                await self._fill(conn, memoryview(head)[1:])
                n, limit = int.from_bytes(head, "big"), min(MAX_HEADER, self.budget.limit)
                if n > limit:
                    raise m.MessageError("too_large", f"header of {n} bytes exceeds {limit}")
                waiting = True
                await self.budget.acquire(n)
                waiting = False
                try:
                    msg = m.decode(await self._exact(conn, n), expect=(m.RemotePut, m.RemoteGet, m.RemoteExists))
                finally:
                    self.budget.release(n)
                if not isinstance(msg, m.RemotePut):
                    return msg, None
                if msg.nbytes > self.max_frame:
                    raise m.MessageError("too_large", f"payload of {msg.nbytes} bytes exceeds --max-frame "
                                                      f"{self.max_frame}")
                waiting = True
                await self.budget.acquire(msg.nbytes)  # before the buffer exists: memory is reserved, then taken
                waiting = False
                try:
                    return msg, await self._exact(conn, msg.nbytes)
                except BaseException:
                    self.budget.release(msg.nbytes)
                    raise
        except TimeoutError:
            if waiting:
                self.counters["busy"] += 1
                raise Closing("busy", f"no room for this frame within --frame-timeout {self.frame_timeout:g}s: "
                                      f"{fmt_bytes(self.budget.used)} of --max-inflight-bytes "
                                      f"{fmt_bytes(self.budget.limit)} are held by frames being received; try "
                                      "again later") from None
            self.counters["frame_timeouts"] += 1
            raise Closing("timeout", f"a frame did not finish within --frame-timeout {self.frame_timeout:g}s "
                                     "(counted from the first byte of its length prefix)") from None

    async def _one(self, conn: socket.socket) -> bool:
        """Serve one request; False when the client closed the connection between frames."""
        head = bytearray(LEN_BYTES)
        if not await self._next_byte(conn, head):
            return False
        msg, data = await self._receive(conn, head)
        out: list[bytes | bytearray]
        if isinstance(msg, m.RemotePut):
            try:
                self.counters["puts"] += 1
                assert data is not None  # _receive reads every put's payload
                if self.store.put(msg.key, data):
                    out = [frame(m.RemoteReply())]
                else:
                    out = [frame(m.ErrorReply(code="too_large", message=f"a {msg.nbytes}-byte chunk is larger "
                                              f"than the server's memory limit {self.store.limit}"))]
            finally:
                self.budget.release(msg.nbytes)  # the store holds (and counts) the bytes now
                del data
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
        await self._send(conn, out)
        return True
