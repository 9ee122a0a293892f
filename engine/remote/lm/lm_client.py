"""LMClient: the blocking lm:// client the remote tier uses; every call bounded in time and in bytes."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Iterator, Sequence

from kvferry.common.errors import UnavailableError
from kvferry.common.secret import ClusterSecret
from kvferry.common.wire import messages as m
from kvferry.engine.remote.lm.protocol import (
    CLIENT_PURPOSE,
    DEFAULT_MAX_CHUNK,
    LEN_BYTES,
    MAX_AUTH_HEADER,
    MAX_HEADER,
    NONCE_BYTES,
    SERVER_PURPOSE,
    frame,
)

Call = tuple[m.Msg, Sequence[bytes | memoryview], int]  # a request, its payload, the largest reply payload wanted


class LMError(UnavailableError, RuntimeError):
    """The lm:// server could not be reached, timed out, refused the request, or sent a reply we cannot trust."""


class LMClient:
    """A blocking client (one connection, reconnected on demand); every call bounded by `timeout`.
    With `secret` (the cluster secret) it proves it to the server, and wants the server to prove
    it back, on every new connection; a server that wants no secret is refused. A get's reply is
    read only up to `max_bytes` (default `max_reply`): a larger one is an LMError, never an
    allocation the server chose."""

    def __init__(self, host: str, port: int, timeout: float = 5.0, secret: ClusterSecret | None = None,
                 max_reply: int = DEFAULT_MAX_CHUNK) -> None:
        self.host, self.port, self.timeout, self.secret = host, port, timeout, secret
        self.max_reply = max_reply
        self._sock: socket.socket | None = None

    @property
    def where(self) -> str:
        return f"lm://{self.host}:{self.port}"

    def _conn(self, deadline: float) -> socket.socket:
        if self._sock is not None and self._stale():
            self.close()  # the server closed it (idle timeout, restart): a fresh one, not a failed call
        if self._sock is None:
            try:
                self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            except OSError as e:
                raise LMError(f"{self.where} unreachable: {e}") from None
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._handshake(deadline)
        return self._sock

    def _stale(self) -> bool:
        """Between calls the server sends nothing: readable now means it closed (or broke) the connection."""
        poller = select.poll()  # not select(): a vLLM worker's descriptors run past FD_SETSIZE
        assert self._sock is not None  # asked of an open connection
        poller.register(self._sock, select.POLLIN)
        return bool(poller.poll(0))  # POLLIN, POLLHUP or POLLERR

    def _frame(self, deadline: float, limit: int = MAX_HEADER,
               expect: tuple[type[m.Msg], ...] | None = None) -> m.Msg:
        """The next header frame, at most `limit` bytes, received by `deadline`."""
        n = int.from_bytes(self._exact(LEN_BYTES, deadline), "big")
        if n > limit:
            raise m.MessageError("too_large", f"reply header of {n} bytes")
        frame = bytes(self._exact(n, deadline))
        return m.decode(frame) if expect is None else m.decode(frame, expect=expect)

    def _until(self, deadline: float) -> socket.socket:
        """The socket, its timeout what is left before `deadline`: set before every send and receive,
        since a socket timeout bounds one call, and a peer trickling bytes would otherwise stretch ours."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        assert self._sock is not None  # _conn() made it
        self._sock.settimeout(left)
        return self._sock

    @contextlib.contextmanager
    def _or_drop(self, what: str) -> Iterator[None]:
        """Any failure inside loses the stream: drop the connection, and raise it as an LMError."""
        try:
            yield
        except LMError:
            self.close()
            raise
        except (OSError, m.MessageError) as e:
            self.close()
            raise LMError(f"{self.where}: {what}{type(e).__name__}: {e}") from None

    def _handshake(self, deadline: float) -> None:
        """The server's greeting and, when it asks, the cluster-secret proof both ways."""
        where = self.where
        with self._or_drop("handshake failed: "):
            try:
                hello = self._frame(deadline, MAX_AUTH_HEADER)
            except TimeoutError:
                raise LMError(f"{where}: no greeting within {self.timeout:g}s: is it a kvferry-server of this "
                              "version, and not overloaded?") from None
            if isinstance(hello, m.ErrorReply):  # e.g. busy: over its --max-connections
                raise LMError(f"{where} refused the connection: {hello.code}: {hello.message}")
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
            assert self.secret is not None  # refused above when the server asks and we have none
            mac = self.secret.mac(CLIENT_PURPOSE, hello.nonce, mine)
            self._until(deadline).sendall(frame(m.AuthAnswer(nonce=mine, mac=mac)))
            ok = self._frame(deadline)
            if isinstance(ok, m.ErrorReply):
                raise LMError(f"{where} refused: {ok.code}: {ok.message}")
            if not isinstance(ok, m.AuthOk) or not self.secret.verify(SERVER_PURPOSE, ok.mac, mine, hello.nonce):
                raise LMError(f"{where} could not prove the cluster secret: it holds another one (or is not the "
                              "server you meant); give both sides the same secret")

    def _exact(self, n: int, deadline: float) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self._until(deadline).recv_into(view[got:])
            if not k:
                raise ConnectionError("server closed the connection")
            got += k
        return buf

    def _calls(self, calls: Sequence[Call]) -> list[tuple[m.RemoteReply, memoryview | None]]:
        """Send every request, then read every reply (one round trip); bounded by `timeout`."""
        deadline = time.monotonic() + self.timeout
        out: list[tuple[m.RemoteReply | m.ErrorReply, memoryview | None]] = []
        self._conn(deadline)
        with self._or_drop(""):
            for msg, payload, _ in calls:
                self._until(deadline).sendall(frame(msg))
                for part in payload:  # sent as they are: no joined copy of a large chunk
                    self._until(deadline).sendall(part)
            for _, _, limit in calls:
                reply = self._frame(deadline, expect=(m.RemoteReply, m.ErrorReply))
                assert isinstance(reply, (m.RemoteReply, m.ErrorReply))  # decode checked `expect`
                found = reply if isinstance(reply, m.RemoteReply) and reply.found else None
                if found is not None and found.nbytes > limit:
                    # Its payload is never read, so the stream is lost: _or_drop drops the connection.
                    raise LMError(f"{self.where} answered with a {found.nbytes}-byte chunk where at most {limit} "
                                  "bytes were expected: another model or chunk layout wrote that key, or the "
                                  "server is not a kvferry-server; treated as a miss")
                out.append((reply, memoryview(self._exact(found.nbytes, deadline)) if found is not None else None))
        replies: list[tuple[m.RemoteReply, memoryview | None]] = []
        for reply, data in out:
            if isinstance(reply, m.ErrorReply):
                raise LMError(f"{self.where} refused: {reply.code}: {reply.message}")
            replies.append((reply, data))
        return replies

    def _call(self, msg: m.Msg, *payload: bytes | memoryview, limit: int = 0) -> tuple[m.RemoteReply,
                                                                                       memoryview | None]:
        return self._calls([(msg, payload, limit)])[0]

    def put(self, key: bytes, *parts: bytes | memoryview) -> None:
        """Store the concatenation of `parts` under `key`."""
        self.put_many([(key, parts)])

    def put_many(self, items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]]) -> None:
        """Store several chunks in one round trip."""
        self._calls([(m.RemotePut(key=key, nbytes=sum(memoryview(p).nbytes for p in parts)), parts, 0)
                     for key, parts in items])

    def get(self, key: bytes, max_bytes: int | None = None) -> memoryview | None:
        """The chunk under `key`, or None; a reply over `max_bytes` (the caller's expected size) is an LMError."""
        return self._call(m.RemoteGet(key=key), limit=self.max_reply if max_bytes is None else max_bytes)[1]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of `keys` the server holds; an answer of another length is an LMError, not a misaligned list."""
        found = list(self._call(m.RemoteExists(keys=list(keys)))[0].found_keys)
        if len(found) != len(keys):
            raise LMError(f"{self.where} answered {len(found)} flags for {len(keys)} keys: not a kvferry-server "
                          "of this version?")
        return found

    def close(self) -> None:
        """Drop the connection; the next call opens a new one."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
