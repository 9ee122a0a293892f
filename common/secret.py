"""The cluster secret: who may talk to kvferry's ports (docs/security.md).

One secret per cluster, from the config key ``cluster_secret`` or ``cluster_secret_file`` (env
``KVFERRY_CLUSTER_SECRET`` / ``KVFERRY_CLUSTER_SECRET_FILE``; the proxy, controller and
kvferry-server take ``--cluster-secret-file`` too). It is stretched once per process with scrypt
(a guess at a short secret costs an attacker that much each), and every key kvferry uses is
derived from the result with keyed BLAKE2b, one purpose each: the CurveZMQ key pairs of every ZMQ
port (common/zsock.py) and the lm:// server's HMAC handshake. The secret itself is never logged,
never sent, and never written anywhere but the file the user (or ``kvferry up``) made for it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field

from kvferry.common.errors import ConfigurationError
from kvferry.common.log import get_logger

logger = get_logger(__name__)

MIN_CHARS = 16
MAX_CHARS = 4096
_SALT = b"kvferry-cluster-secret-v1"


class SecretError(ConfigurationError, ValueError):
    """A cluster secret that cannot be used; the message names the key and the fix."""


def generate() -> str:
    """A new random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ClusterSecret:
    """The stretched secret; its repr shows nothing of it."""

    master: bytes = field(repr=False)

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    def key(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose; different purposes give unrelated keys."""
        return hashlib.blake2b(purpose.encode(), key=self.master, digest_size=32).digest()

    def mac(self, purpose: str, *parts: bytes) -> bytes:
        """HMAC-SHA256 over `parts` (length-prefixed, so no two splits collide) with `purpose`'s key."""
        h = hmac.new(self.key(purpose), digestmod=hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "big"))
            h.update(p)
        return h.digest()

    def verify(self, purpose: str, tag: bytes, *parts: bytes) -> bool:
        return hmac.compare_digest(tag, self.mac(purpose, *parts))


@functools.lru_cache(maxsize=8)
def _stretch(text: str) -> ClusterSecret:
    # scrypt: ~16 MiB and tens of ms once per process; the result is cached per secret.
    return ClusterSecret(hashlib.scrypt(text.encode(), salt=_SALT, n=1 << 14, r=8, p=1, dklen=32))


def from_text(text: str, source: str) -> ClusterSecret:
    text = text.strip()
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        raise SecretError(f"{source}: the cluster secret has {len(text)} characters; it needs {MIN_CHARS} to "
                          f"{MAX_CHARS}: make one with `kvferry secret` (or `openssl rand -hex 32`)")
    return _stretch(text)


def from_file(path: str, source: str) -> ClusterSecret:
    """Read a secret file; one that others may read is used, with a warning naming chmod."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CHARS + 1)
    except OSError as e:
        raise SecretError(f"{source}: cannot read the cluster secret file {path!r} ({e.strerror}): fix the "
                          "path or its permissions") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("cluster secret file %s can be read by other users: chmod 600 %s", path, path)
    return from_text(text, f"{source} ({path})")


def load(text: str | None, path: str | None, source: str = "config") -> ClusterSecret | None:
    """The secret from a text or a file (not both); None when neither is set."""
    if text and path:
        raise SecretError(f"{source}: both cluster_secret and cluster_secret_file are set: keep one")
    if text:
        return from_text(text, f"{source} cluster_secret")
    if path:
        return from_file(path, f"{source} cluster_secret_file")
    return None


def from_env(path: str | None = None, source: str = "command line") -> ClusterSecret | None:
    """For the stand-alone servers (proxy, controller, kvferry-server): a --cluster-secret-file,
    else KVFERRY_CLUSTER_SECRET / KVFERRY_CLUSTER_SECRET_FILE."""
    if path:
        return from_file(path, f"{source} --cluster-secret-file")
    env = os.environ
    return load(env.get("KVFERRY_CLUSTER_SECRET"), env.get("KVFERRY_CLUSTER_SECRET_FILE"), "env")


def authorized(header: str | None, key: str) -> bool:
    """An HTTP Authorization header carrying `key` (an API or admin key): `Bearer <key>`, or Basic
    auth with `key` as the password (what a browser sends). Compared in constant time."""
    scheme, _, cred = (header or "").strip().partition(" ")
    cred = cred.strip()
    if scheme.lower() == "bearer":
        given = cred.encode("utf-8", "surrogateescape")
    elif scheme.lower() == "basic":
        try:
            given = base64.b64decode(cred, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
    else:
        return False
    return hmac.compare_digest(given, key.encode())


def write_file(path: str, text: str, replace: bool = True) -> None:
    """Write a secret file readable by its owner only.

    The text goes into a new file made with O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600 beside
    `path` (never world-readable, not even briefly), which then takes `path`'s name: renamed over
    it (`replace`: a file or link there is replaced, never written through, so a symlink planted
    at `path` cannot redirect the secret and an old 0644 file never holds it), or linked to it
    only if nothing is there (FileExistsError otherwise, a dangling symlink included)."""
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(8):
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"cannot make a temporary file beside {path}")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path, follow_symlinks=False)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
