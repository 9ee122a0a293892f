"""Redis credentials and TLS files from the config (docs/redis.md): each key also from extra_config
(under its own name or redis-py's, which LMCache users know from its URLs), passwords from a file
or the environment so they need not sit in a config or URL, checked once at start-up so a wrong
path or a contradiction is one ConfigError naming the key, not a stream of remote misses."""

from __future__ import annotations

from kvferry.common.config import REDIS_SCHEMES, ConfigError, KVFerryConfig
from kvferry.common.password_file import PasswordFileError, read_password_file
from kvferry.engine.remote.backend import RemoteError
from kvferry.engine.remote.redis_backend import (
    RedisSettings,
    client_kwargs,
    parse_redis_url,
)

# Other names an extra_config may use for a key (redis-py's, as in LMCache's rediss:// URLs).
ALIASES = {"remote_tls_ca_file": ("ssl_ca_certs",), "remote_tls_cert_file": ("ssl_certfile",),
           "remote_tls_key_file": ("ssl_keyfile",)}
KEYS = ("remote_username", "remote_password", "remote_password_file", "remote_sentinel_username",
        "remote_sentinel_password", "remote_sentinel_password_file", "remote_tls_ca_file", "remote_tls_cert_file",
        "remote_tls_key_file")


def _option(cfg: KVFerryConfig, key: str) -> tuple[str | None, str]:
    """(value, where it came from) of a key set as a config key or in extra_config; both set to
    different values is an error."""
    found: list[tuple[str, str]] = []
    if getattr(cfg, key) is not None:
        found.append((getattr(cfg, key), f"config key {key}"))
    extra = cfg.extra_config or {}
    for name in (key, *ALIASES.get(key, ())):
        value = extra.get(name, extra.get(f"kvferry.{name}", extra.get(f"lmcache.{name}")))
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConfigError(f"extra_config {name}: expected a string, got {type(value).__name__}")
        found.append((value, f"extra_config {name}"))
    if len({v for v, _ in found}) > 1:
        raise ConfigError(f"{' and '.join(src for _, src in found)} are set to different values: keep one")
    return found[0] if found else (None, "")


def _read_password(path: str, source: str) -> str:
    try:
        return read_password_file(path, source)
    except PasswordFileError as e:
        raise ConfigError(str(e)) from None


def _password(cfg: KVFerryConfig, key: str) -> tuple[str | None, str]:
    text, text_src = _option(cfg, key)
    path, path_src = _option(cfg, f"{key}_file")
    if text is not None and path is not None:
        raise ConfigError(f"{text_src} and {path_src} are both set: keep one")
    if path is not None:
        return _read_password(path, path_src), f"{path_src} ({path})"
    return text, text_src


def from_config(cfg: KVFerryConfig) -> RedisSettings | None:
    """The Redis settings of `cfg`, checked against its remote_url; None when the store is not Redis
    and none is set. ConfigError names the key to fix."""
    url = cfg.remote_url or ""
    scheme = url.partition("://")[0]
    values = {key: _option(cfg, key) for key in KEYS}
    if scheme not in REDIS_SCHEMES:
        given = [src for key, (v, src) in values.items() if v is not None]
        if given and url:
            raise ConfigError(f"{given[0]} is set but remote_url is {scheme}://, not Redis: remove it "
                              "(lm:// proves the cluster secret instead)")
        return None
    password, password_from = _password(cfg, "remote_password")
    sentinel_password, _ = _password(cfg, "remote_sentinel_password")
    settings = RedisSettings(
        username=values["remote_username"][0], password=password, password_from=password_from,
        sentinel_username=values["remote_sentinel_username"][0], sentinel_password=sentinel_password,
        tls_ca_file=values["remote_tls_ca_file"][0], tls_cert_file=values["remote_tls_cert_file"][0],
        tls_key_file=values["remote_tls_key_file"][0])
    tls = [values[k][1] for k in ("remote_tls_ca_file", "remote_tls_cert_file", "remote_tls_key_file")
           if values[k][0] is not None]
    if tls and scheme != "rediss":
        raise ConfigError(f"{tls[0]} is set but remote_url is {scheme}://: TLS needs rediss://host:port "
                          "(TLS to Sentinel-managed Redis is not supported)")
    sentinel = [values[k][1] for k in ("remote_sentinel_username", "remote_sentinel_password",
                                        "remote_sentinel_password_file") if values[k][0] is not None]
    if sentinel and scheme != "redis-sentinel":
        raise ConfigError(f"{sentinel[0]} is set but remote_url is {scheme}://: the Sentinel's credentials "
                          "are for redis-sentinel:// (the server's password is remote_password)")
    try:
        client_kwargs(parse_redis_url(url), settings, 1.0)  # the URL, the TLS files and no contradiction
    except RemoteError as e:
        raise ConfigError(f"remote_url: {e}") from None
    return settings
