"""Redis backends of the remote tier: one bounded connection to a Redis server or to the master
a Sentinel set names, with passwords and TLS as people run Redis (docs/redis.md); kept apart from
tiers/remote.py so Redis auth and TLS evolve on their own.

URL forms (credentials percent-encoded where they hold ``:@/?#%``):

- ``redis://[[user]:password@]host:port[/db]``
- ``rediss://[[user]:password@]host:port[/db][?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...]``
  (TLS; the query names are redis-py's, as LMCache hands its URL to redis-py)
- ``redis-sentinel://[[user]:password@]h1:p1,h2:p2[/service]``: the credentials are the master's;
  the Sentinels' own come from ``remote_sentinel_password`` (and ``remote_sentinel_username``).

Every message shows a URL with its password replaced by ``***``; a refused password or a failed TLS
handshake is one line naming the setting that fixes it.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

from kvferry.common.log import get_logger
from kvferry.common.redact import redact_url, userinfo_split
from kvferry.engine.remote.backend import PREFIX, Item, Mapped, RemoteError, hostports

logger = get_logger(__name__)

# redis-py's URL query names for TLS and the config keys they stand for.
TLS_QUERY = {"ssl_ca_certs": "remote_tls_ca_file", "ssl_certfile": "remote_tls_cert_file",
             "ssl_keyfile": "remote_tls_key_file"}
TLS_FLAGS = ("ssl_cert_reqs", "ssl_check_hostname")  # to relax the server check, for who must
PASSWORD_KEYS = "remote_password, remote_password_file or env KVFERRY_REMOTE_PASSWORD, or user:password@ in remote_url"
SENTINEL_KEYS = "remote_sentinel_password or remote_sentinel_password_file (remote_sentinel_username for an ACL user)"
TLS_KEYS = "remote_tls_ca_file (the CA that signed the server's certificate)"
CLIENT_CERT_KEYS = "remote_tls_cert_file and remote_tls_key_file"


@dataclass(frozen=True)
class RedisURL:
    """A parsed Redis remote_url; `shown` is the URL with its password redacted."""

    scheme: str
    nodes: list[tuple[str, int]]
    shown: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    service: str = ""
    query: dict[str, str] = field(default_factory=dict)


def parse_redis_url(url: str) -> RedisURL:
    """The parts of a redis://, rediss:// or redis-sentinel:// URL, or RemoteError naming the fix."""
    shown = redact_url(url)
    scheme, _, rest = url.partition("://")
    username = password = None
    split = userinfo_split(url)
    if split is not None:
        _, userinfo, at_rest = split
        rest = at_rest[1:]
        user, colon, pw = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(pw) if colon else None
    rest, _, query_text = rest.partition("?")
    addrs, _, path = rest.partition("/")
    nodes = hostports(addrs, shown)
    if scheme != "redis-sentinel" and len(nodes) != 1:
        raise RemoteError(f"remote_url {shown!r}: {scheme}:// takes one host:port")
    db, service = 0, ""
    if scheme == "redis-sentinel":
        service = unquote(path)
    elif path:
        if not path.isdigit():
            raise RemoteError(f"remote_url {shown!r}: the path /{path} is not a database number (e.g. /0)")
        db = int(path)
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    allowed = (*TLS_QUERY, *TLS_FLAGS) if scheme == "rediss" else ()
    for name in query:
        if name not in allowed:
            raise RemoteError(f"remote_url {shown!r}: query parameter {name!r} is not supported"
                              + (f": use one of {', '.join(allowed)}" if allowed else
                                 ": TLS options need rediss://host:port"))
    return RedisURL(scheme, nodes, shown, username, password, db, service, query)


@dataclass(frozen=True)
class RedisSettings:
    """Credentials and TLS files for Redis, from config keys (engine/remote/redis_settings.py reads them);
    its repr shows no password. `password_from` names the key a password came from, for errors."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_from: str = ""
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None


def _redis_kwargs(timeout: float) -> dict:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries inside redis-py: one bounded attempt, the tier's back-off decides when to try again.
    return {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": Retry(NoBackoff(), 0)}


def _flag(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "no", "off")


def _tls_kwargs(u: RedisURL, s: RedisSettings) -> dict:
    """redis-py's TLS arguments for a rediss:// URL, after checking the files load; RemoteError
    naming the key otherwise."""
    kw: dict = {"ssl": True}
    files: dict[str, str | None] = {"ssl_ca_certs": s.tls_ca_file, "ssl_certfile": s.tls_cert_file,
                                    "ssl_keyfile": s.tls_key_file}
    for name, config_key in TLS_QUERY.items():
        if u.query.get(name):
            if files[name] and files[name] != u.query[name]:
                raise RemoteError(f"{config_key} and ?{name}= in remote_url name different files: keep one")
            files[name] = u.query[name]
    reqs = u.query.get("ssl_cert_reqs", "required").strip().lower()
    if reqs not in ("none", "optional", "required"):
        raise RemoteError(f"remote_url {u.shown!r}: ssl_cert_reqs={reqs!r} is not none, optional or required")
    for name, path in files.items():
        if path and not os.access(path, os.R_OK):
            raise RemoteError(f"{TLS_QUERY[name]} {path!r} cannot be read: fix the path or its permissions")
    ca = files["ssl_ca_certs"]
    if reqs != "none":
        try:
            ctx = ssl.create_default_context(cafile=ca)
        except (ssl.SSLError, OSError) as e:
            raise RemoteError(f"remote_tls_ca_file {ca!r} holds no usable CA certificate ({e}): point it at the "
                              "PEM file of the CA that signed the Redis server's certificate") from None
        if ca is None and not _system_cas(ctx):
            raise RemoteError(f"{u.shown}: rediss:// needs a CA to check the server's certificate and this host has "
                              f"no system CA bundle: set {TLS_KEYS}")
    elif (u.shown, "reqs") not in _warned_unchecked:  # once per URL, not per connection
        _warned_unchecked.add((u.shown, "reqs"))
        logger.warning("%s: ssl_cert_reqs=none: the server's certificate is not checked (anyone on the path can "
                       "pose as it); set remote_tls_ca_file instead", u.shown)
    check_hostname = reqs != "none" and _flag(u.query.get("ssl_check_hostname", "true"))
    if reqs != "none" and not check_hostname and (u.shown, "hostname") not in _warned_unchecked:
        _warned_unchecked.add((u.shown, "hostname"))
        logger.warning("%s: ssl_check_hostname=false: any certificate the CA signed is taken as this server's; "
                       "connect by a name the server's certificate holds instead", u.shown)
    cert, key = files["ssl_certfile"], files["ssl_keyfile"]
    if key and not cert:
        raise RemoteError("remote_tls_key_file is set without remote_tls_cert_file: set both (or neither)")
    if cert:
        try:
            ssl.create_default_context().load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as e:
            raise RemoteError(f"remote_tls_cert_file {cert!r} / remote_tls_key_file {key!r} are not a client "
                              f"certificate and its private key ({e}): fix {CLIENT_CERT_KEYS}") from None
    kw.update(ssl_ca_certs=ca, ssl_certfile=cert, ssl_keyfile=key, ssl_cert_reqs=reqs,
              ssl_check_hostname=check_hostname)
    return kw


_warned_unchecked: set[tuple[str, str]] = set()


def _system_cas(ctx: ssl.SSLContext) -> bool:
    """Whether this host has CA certificates to check a server with (OpenSSL's default file or folder)."""
    if ctx.cert_store_stats()["x509_ca"]:
        return True
    paths = ssl.get_default_verify_paths()
    return bool((paths.cafile and os.path.isfile(paths.cafile))
                or (paths.capath and os.path.isdir(paths.capath) and os.listdir(paths.capath)))


def client_kwargs(u: RedisURL, s: RedisSettings, timeout: float) -> dict:
    """redis-py's arguments for the master (or the one server): timeouts, credentials, database, TLS."""
    if u.password is not None and s.password is not None:
        raise RemoteError(f"remote_url {u.shown!r} has a password and {s.password_from or 'remote_password'} is set "
                          "too: keep one")
    kw = _redis_kwargs(timeout)
    kw.update(username=u.username or s.username, password=u.password if u.password is not None else s.password,
              db=u.db)
    if u.scheme == "rediss":
        kw.update(_tls_kwargs(u, s))
    return kw


def _causes(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cause: BaseException | None = e
    while cause is not None and len(out) < 8:
        out.append(cause)
        cause = cause.__cause__ or cause.__context__
    return out


def explain(e: Exception, u: RedisURL, s: RedisSettings) -> str:
    """A redis-py error as one line: what failed and the setting that fixes it."""
    import redis

    text = f"{type(e).__name__}: {e}"
    chain = _causes(e)
    if isinstance(e, redis.sentinel.MasterNotFoundError):
        text = _short_master_not_found(str(e))
    if isinstance(e, redis.sentinel.MasterNotFoundError) and ("AuthenticationError" in text or "NOAUTH" in text):
        if s.sentinel_password is None:
            return f"the Sentinels want a password ({text}): set {SENTINEL_KEYS}"
        return f"a Sentinel refused our credentials ({text}): fix {SENTINEL_KEYS}"
    if any(isinstance(c, redis.AuthenticationError) for c in chain) or "NOAUTH" in text or "WRONGPASS" in text:
        given = "remote_url" if u.password is not None else s.password_from
        if not given:
            return f"Redis wants a password ({text}): set {PASSWORD_KEYS}"
        return f"Redis refused our credentials ({text}; the password in use is from {given}): fix {PASSWORD_KEYS}"
    if u.scheme == "rediss":
        if any(isinstance(c, ssl.SSLCertVerificationError) for c in chain):
            if "hostname" in text.lower() or "IP address mismatch" in text:
                return (f"TLS: the server's certificate does not name the host in remote_url ({text}): connect by a "
                        "name or address the certificate holds")
            return f"TLS: the server's certificate is not trusted ({text}): set {TLS_KEYS}"
        if any(isinstance(c, ssl.SSLError) for c in chain):
            return (f"TLS handshake failed ({text}): if the server checks clients, set {CLIENT_CERT_KEYS}; "
                    f"check {TLS_KEYS}")
        if any("handshake" in str(c).lower() for c in chain):
            return f"TLS handshake failed ({text}): is the port a TLS port (tls-port)? plain Redis wants redis://"
    elif "reset by peer" in text or "Connection closed by server" in text:
        return f"{text} (if the port speaks TLS, use rediss://)"
    return text


def _short_master_not_found(message: str) -> str:
    """redis-py's MasterNotFoundError, without the full repr of every Sentinel client it tried."""
    head, _, tried = message.partition(" : ")
    why = [f"{host}:{port} {err.strip()}" for host, port, err in _TRIED.findall(tried)]
    return f"MasterNotFoundError: {head}" + (f" ({'; '.join(why)})" if why else "")


_TRIED = re.compile(r"host=([^,>]+),port=(\d+),.*?\)> - (.+?)(?=, <redis\.|$)")


class RedisBackend(Mapped):
    def __init__(self, client: Any, where: str, url: RedisURL, settings: RedisSettings) -> None:  # redis.Redis
        import redis

        self.r, self.where, self.errors = client, where, (redis.RedisError,)
        self.url, self.settings = url, settings

    @classmethod
    def connect(cls, u: RedisURL, settings: RedisSettings, timeout: float) -> RedisBackend:
        import redis

        (host, port), = u.nodes
        return cls(redis.Redis(host=host, port=port, **client_kwargs(u, settings, timeout)), u.shown, u, settings)

    def _do(self, fn, *args):  # noqa: ANN001, ANN202
        try:
            return fn(*args)
        except self.errors as e:
            raise RemoteError(f"{self.where}: {explain(e, self.url, self.settings)}") from None

    def put_many(self, items: Sequence[Item]) -> None:
        pipe = self.r.pipeline(transaction=False)  # one round trip for the batch
        for key, head, payload in items:
            k = PREFIX + key
            pipe.mset({k + b":h": head, k + b":d": payload})
        self._do(pipe.execute)

    def get(self, key: bytes, max_bytes: int) -> tuple[bytes, bytes] | None:
        k = PREFIX + key
        pipe = self.r.pipeline(transaction=False)  # one round trip; GETRANGE bounds what Redis sends
        pipe.getrange(k + b":h", 0, max_bytes)
        pipe.getrange(k + b":d", 0, max_bytes)
        head, payload = self._do(pipe.execute)
        return (head, payload) if head and payload else None  # GETRANGE gives b"" for a missing key

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        pipe = self.r.pipeline(transaction=False)  # one round trip; EXISTS answers 0/1, never a value
        for k in keys:
            pipe.exists(PREFIX + k + b":h")
        return [bool(v) for v in self._do(pipe.execute)]

    def close(self) -> None:
        self.r.close()


def sentinel_backend(u: RedisURL, settings: RedisSettings, timeout: float) -> RedisBackend:
    """The master a Sentinel set names: the Sentinels get their own credentials, the master the URL's
    (or remote_password's)."""
    from redis.sentinel import Sentinel

    service = u.service or os.environ.get("REDIS_SERVICE_NAME", "")
    master_kw = client_kwargs(u, settings, timeout)
    sentinel_kw = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                   "username": settings.sentinel_username, "password": settings.sentinel_password}
    sentinel = Sentinel(u.nodes, sentinel_kwargs=sentinel_kw, **master_kw)
    if not service:
        masters: dict = {}
        errors: list[str] = []
        for s in sentinel.sentinels:
            try:
                masters = s.sentinel_masters()
                break
            except Exception as e:  # noqa: BLE001 - try the next Sentinel
                errors.append(_sentinel_error(e, u, settings))
                continue
        else:
            raise RemoteError(f"{u.shown}: no Sentinel answered ({'; '.join(errors)})")
        if len(masters) != 1:
            raise RemoteError(f"{u.shown}: the Sentinels monitor {len(masters)} masters "
                              f"({', '.join(masters) or 'none'})"
                              f": name one as {u.shown.partition('?')[0]}/<service> or in $REDIS_SERVICE_NAME")
        service = next(iter(masters))
    return RedisBackend(sentinel.master_for(service, **master_kw), f"{u.shown} (service {service})", u, settings)


def _sentinel_error(e: Exception, u: RedisURL, s: RedisSettings) -> str:
    import redis

    if isinstance(e, redis.AuthenticationError) or "NOAUTH" in str(e) or "WRONGPASS" in str(e):
        want = "want a password" if s.sentinel_password is None else "refused our credentials"
        return f"the Sentinels {want} ({type(e).__name__}: {e}): set {SENTINEL_KEYS}"
    return f"{type(e).__name__}: {e}"


def open_redis(url: str, timeout: float, settings: RedisSettings | None = None) -> RedisBackend:
    """A connection (made lazily by redis-py) to the Redis server or Sentinel-named master of `url`."""
    u = parse_redis_url(url)
    settings = settings or RedisSettings()
    if u.scheme != "redis-sentinel":
        return RedisBackend.connect(u, settings, timeout)
    try:
        return sentinel_backend(u, settings, timeout)
    except RemoteError:
        raise
    except Exception as e:  # noqa: BLE001 - redis-py's errors while finding the master
        raise RemoteError(f"{u.shown}: {explain(e, u, settings)}") from None
