"""One typed configuration for every kvferry component, drop-in compatible with LMCache's keys.

Sources, lowest precedence first (a later one overrides an earlier one key by key):

1. built-in defaults,
2. the YAML file named by ``KVFERRY_CONFIG_FILE`` (or LMCache's ``LMCACHE_CONFIG_FILE``),
3. environment variables ``LMCACHE_<KEY>`` then ``KVFERRY_<KEY>`` (KVFERRY wins over LMCACHE),
4. a dict, e.g. vLLM's ``kv_connector_extra_config`` (keys may carry a ``lmcache.`` or
   ``kvferry.`` prefix).

Unknown keys, wrong types and contradictions raise :class:`ConfigError` with one line naming the
key, where it came from, and the fix.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

import msgspec
import yaml

from kvferry.common import secret
from kvferry.common.errors import ConfigurationError
from kvferry.common.log import get_logger
from kvferry.common.redact import redact_url

logger = get_logger(__name__)

Ports = Union[int, list[int], None]


class ConfigError(ConfigurationError, ValueError):
    """A configuration problem; the message is one line that names the key and the fix."""


class KVFerryConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every key kvferry reads. Sizes: GB where LMCache says GB, bytes for *_buffer_size."""

    # --- KV engine ---
    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0  # GB
    local_disk: str | None = None  # "file:///path/" or a plain path
    max_local_disk_size: float = 0.0  # GB
    remote_url: str | None = None
    remote_serde: str = "naive"
    # remote_serde cachegen: quantization bins [first layers, the rest] for K and for V (docs/offload.md)
    cachegen_key_bins: list[int] = msgspec.field(default_factory=lambda: [32, 16])
    cachegen_value_bins: list[int] = msgspec.field(default_factory=lambda: [32, 16])
    # Redis credentials and TLS (docs/redis.md); each also from extra_config. Passwords are never logged.
    remote_username: str | None = None  # an ACL user; or user:password@ in remote_url
    remote_password: str | None = None  # or remote_password_file, or env KVFERRY_REMOTE_PASSWORD
    remote_password_file: str | None = None
    remote_sentinel_username: str | None = None  # the Sentinels' own credentials (redis-sentinel://)
    remote_sentinel_password: str | None = None
    remote_sentinel_password_file: str | None = None
    remote_tls_ca_file: str | None = None  # rediss://: the CA that signed the server's certificate
    remote_tls_cert_file: str | None = None  # rediss://: a client certificate, for servers that check clients
    remote_tls_key_file: str | None = None
    save_unfull_chunk: bool = True
    discard_partial_chunks: bool = False
    enable_async_loading: bool = False
    use_layerwise: bool = False
    save_decode_cache: bool = False
    blocking_timeout_secs: float = 10.0
    cache_policy: str = "LRU"
    numa_mode: str | None = None
    pre_caching_hash_algorithm: str = "xxh3_128"
    py_enable_gc: bool = True
    use_experimental: bool = True  # LMCACHE_USE_EXPERIMENTAL; kvferry has one engine
    lmcache_rpc_port: str | int | None = None  # LMCache's per-instance RPC name; unused

    # --- prefill/decode disaggregation ---
    enable_pd: bool = False
    pd_role: str | None = None  # "sender" (prefiller) | "receiver" (decoder)
    pd_buffer_size: int = 1 << 30  # bytes
    pd_buffer_device: str | None = None  # unset: the KV cache's device; set: must name that device
    pd_peer_host: str | None = None  # where the decoder's receiver binds (LMCache's key)
    # the address prefillers dial for it (kvferry; default pd_peer_host, or this machine's address
    # when that is 0.0.0.0 / ::): what discovery registers; a static proxy takes it per decoder
    # (--decoder URL,INIT,ALLOC,HOST)
    pd_peer_advertise_host: str | None = None
    pd_peer_init_port: Ports = None  # one per decoder TP rank
    pd_peer_alloc_port: Ports = None
    pd_proxy_host: str | None = None
    pd_proxy_port: int | None = None
    transfer_channel: str | None = None  # "nixl"
    nixl_buffer_size: int | None = None
    nixl_buffer_device: str | None = None
    # kvferry's own bounds on every wait of the transfer path (seconds).
    pd_handshake_timeout: float = 5.0
    pd_alloc_timeout: float = 10.0
    pd_lease_seconds: float = 30.0
    pd_kv_ready_timeout: float = 30.0
    pd_kv_timeout_action: str = "recompute"  # "recompute" | "fail"
    pd_chunk_format: str = "block"  # "block" | "token"
    # An arrived transfer whose decode request the decoder's scheduler already holds (queued
    # behind others) is kept this long instead of pd_lease_seconds.
    pd_queue_seconds: float = 600.0

    # --- P2P sharing and controller ---
    enable_p2p: bool = False
    p2p_host: str | None = None  # where the P2P ports bind
    p2p_advertise_host: str | None = None  # the address peers are told (default p2p_host, as above)
    p2p_init_ports: Ports = None
    p2p_lookup_ports: Ports = None
    enable_controller: bool = False
    lmcache_instance_id: str = "kvferry_default_instance"
    controller_url: str | None = None
    controller_pull_url: str | None = None
    controller_reply_url: str | None = None
    lmcache_worker_ports: Ports = None
    lmcache_worker_heartbeat_time: float = 10.0
    lmcache_worker_heartbeat_timeout: float = 30.0

    # --- network (docs/deploy.md "Network") ---
    # the NIC UCX (NIXL's transport) uses, e.g. "eth1" or "mlx5_0:1": becomes UCX_NET_DEVICES for
    # kvferry's NIXL agents when that is not set in the environment
    nixl_net_devices: str | None = None
    # vLLM's KV events (plain ZMQ: keep vLLM's --kv-events-config endpoint on ipc:// or loopback)
    # relayed by kvferry on ports that speak CurveZMQ with the cluster secret; the proxy's
    # --kv-events names these (common/kv_events_relay.py)
    kv_events_relay_host: str | None = None  # bind address (default 127.0.0.1)
    kv_events_relay_port: int | None = None
    kv_events_relay_replay_port: int | None = None

    # --- traces (docs/observability.md "Traces") ---
    # the OTLP collector the connector's KV spans go to; unset: env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    # (which vLLM's --otlp-traces-endpoint sets for its processes), else no spans
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str | None = None  # "grpc" | "http/protobuf"; unset: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc

    # --- trust (docs/security.md) ---
    cluster_secret: str | None = None  # or cluster_secret_file; never logged
    cluster_secret_file: str | None = None
    require_cluster_secret: bool = False  # a port beyond loopback without a secret is an error

    # --- vLLM ---
    # Start with a vLLM release outside the checked range (connector/vllm_version.py), with a warning.
    allow_unsupported_vllm: bool = False

    # Free-form, backend-specific settings (Mooncake, NIXL storage, lookup_backoff_time, ...).
    extra_config: dict[str, Any] | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={_shown(f, getattr(self, f))!r}" for f in self.__struct_fields__)
        return f"KVFerryConfig({fields})"

    def ports(self, key: str) -> list[int]:
        """A port key as a list (one entry per TP rank); [] when unset."""
        value = getattr(self, key)
        if value is None:
            return []
        return [value] if isinstance(value, int) else list(value)


# Values a repr, log line or error must not show (also as extra_config entries).
SECRET_KEYS = frozenset({"cluster_secret", "remote_password", "remote_sentinel_password"})


def _shown(key: str, value: Any) -> Any:
    """`value` as it may be shown: secrets hidden, a password in a URL redacted."""
    if key in SECRET_KEYS and value:
        return "<hidden>"
    if key == "remote_url":
        return redact_url(value) if value else value
    if key == "extra_config" and isinstance(value, dict):
        return {k: _shown(_canonical(str(k)), v) for k, v in value.items()}
    return value


FIELD_TYPES: dict[str, Any] = {
    f.name: f.type for f in msgspec.structs.fields(KVFerryConfig)
}

# Environment variables that are not config keys.
# kvferry's own switches (docs/configuration.md, environment variables).
_NON_KEY_ENV = {"CONFIG_FILE", "LOG_LEVEL", "CACHE_DIR", "NATIVE_COPY", "BENCH_DEBUG", "TEST_LOG_DIR",
                "TEST_TRACE_DUMP", "LOCUST_MODEL", "LOCUST_MAX_TOKENS"}
_PREFIXES = ("lmcache.", "kvferry.")
# The one list of each: the remote tier (engine/tiers/remote.py, engine/remote/) and the serde
# (engine/remote/serde.py) import these. LMCache's other values load, so LMCache's config files do, and the
# engine refuses them at start with a line naming the fix.
REDIS_SCHEMES = ("redis", "rediss", "redis-sentinel")
REMOTE_SCHEMES = ("lm", *REDIS_SCHEMES, "mooncakestore")
LMCACHE_ONLY_SCHEMES = ("infinistore",)
SERDES = ("naive", "zstd", "cachegen")
CACHEGEN_BINS = (4, 64)  # the fewest and most quantization bins a cachegen group may use
# Keys LMCache knows that kvferry accepts for drop-in use but does not act on, and why; each one a
# config sets is logged once per process (load_config).
IGNORED_KEYS: dict[str, str] = {
    "cache_policy": "the CPU and disk tiers always evict least recently used first (LRU)",
    "discard_partial_chunks": "use save_unfull_chunk (false: a prompt's last, partial chunk is not stored)",
    "pre_caching_hash_algorithm": "chunk keys are always chained xxh3_128 salted by model and KV layout",
    "enable_async_loading": "loads run in the connector's start_load_kv; there is no separate async mode",
    "save_decode_cache": "kvferry stores prompt (prefill) KV only",
    "nixl_buffer_size": "the PD transfer buffer's size is pd_buffer_size",
    "nixl_buffer_device": "the pd_buffer sits on the KV cache's device (pd_buffer_device may only name it)",
    "numa_mode": "kvferry does no NUMA placement; pin the process with numactl/taskset",
    "use_layerwise": "KV moves a whole chunk at a time, not layer by layer",
    "py_enable_gc": "kvferry leaves Python's garbage collector as it is",
    "lmcache_rpc_port": "kvferry has no per-instance RPC port",
    "use_experimental": "kvferry has one engine",
}
_logged_ignored: set[str] = set()

ChunkFormat = Literal["block", "token"]


def _type_name(tp: Any) -> str:
    args = get_args(tp)
    if get_origin(tp) in (Union, type(int | None)) or (args and type(None) in args):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    if get_origin(tp) is list:
        return f"list of {_type_name(args[0])}"
    if get_origin(tp) is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(key: str, value: Any, source: str) -> Any:
    tp = FIELD_TYPES[key]
    try:
        return msgspec.convert(value, tp, strict=True)
    except msgspec.ValidationError:
        raise ConfigError(
            f"config key {key} ({source}): expected {_type_name(tp)}, got "
            f"{type(value).__name__} {_shown(key, value)!r}"  # a secret of the wrong type stays hidden
        ) from None


def _parse_env(key: str, raw: str, source: str) -> Any:
    """Env values are strings; read them as YAML scalars unless the key is a plain string."""
    tp = FIELD_TYPES[key]
    allows_none = type(None) in get_args(tp)
    if allows_none and raw.strip().lower() in ("", "none", "null"):
        return None
    if tp in (str, str | None):
        return raw
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return _convert(key, value, source)


def _canonical(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _unknown(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, FIELD_TYPES, n=3, cutoff=0.75)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see docs/configuration.md"
    return ConfigError(f"unknown config key {key!r} ({source}){hint}")


def read_yaml(path: str, source: str) -> dict[str, Any]:
    """Read a config YAML file into a dict, with errors that name the file."""
    if not os.path.isfile(path):
        raise ConfigError(f"{source}: config file {path!r} does not exist: fix the path")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {path!r} must hold a mapping of keys, got {type(data).__name__}")
    return data


def config_file_from_env(env: Mapping[str, str]) -> tuple[str, str] | None:
    for var in ("KVFERRY_CONFIG_FILE", "LMCACHE_CONFIG_FILE"):
        if env.get(var):
            return env[var], var
    return None


def load_config(
    extra: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    path: str | None = None,
) -> KVFerryConfig:
    """Merge defaults < YAML file < env < `extra` into a validated KVFerryConfig."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    file_src = (path, "config file") if path else config_file_from_env(env)
    if file_src:
        fpath, var = file_src
        for key, value in read_yaml(fpath, var).items():
            key = _canonical(str(key))
            source = f"{fpath}"
            if key not in FIELD_TYPES:
                raise _unknown(key, source)
            values[key] = _convert(key, value, source)
            sources[key] = source

    for prefix in ("LMCACHE_", "KVFERRY_"):
        for var, raw in env.items():
            if not var.startswith(prefix) or var[len(prefix):] in _NON_KEY_ENV:
                continue
            key = var[len(prefix):].lower()
            if key not in FIELD_TYPES:
                if prefix == "KVFERRY_":
                    raise _unknown(key, f"env {var}")
                # LMCache has many env switches of its own; a drop-in must not die on them.
                logger.warning("ignoring env %s: not a kvferry config key", var)
                continue
            values[key] = _parse_env(key, raw, f"env {var}")
            sources[key] = f"env {var}"

    for key, value in (extra or {}).items():
        ckey = _canonical(str(key))
        if ckey not in FIELD_TYPES:
            raise _unknown(ckey, "kv_connector_extra_config")
        values[ckey] = _convert(ckey, value, "kv_connector_extra_config")
        sources[ckey] = "kv_connector_extra_config"

    config = msgspec.convert(values, KVFerryConfig)
    validate(config, sources)
    log_ignored(sources)
    return config


def log_ignored(sources: Mapping[str, str]) -> None:
    """One line per ignored key that `sources` sets, each key once per process."""
    for key, why in IGNORED_KEYS.items():
        if key in sources and key not in _logged_ignored:
            _logged_ignored.add(key)
            logger.info("config key %s (%s): accepted for LMCache compatibility, ignored by kvferry: %s",
                        key, sources[key], why)


def _src(sources: Mapping[str, str], key: str) -> str:
    return sources.get(key, "not set")


def validate(c: KVFerryConfig, sources: Mapping[str, str] | None = None) -> None:
    """Reject values and combinations that cannot work, naming the key and the fix."""
    s = sources or {}

    def err(key: str, msg: str) -> ConfigError:
        return ConfigError(f"config key {key} ({_src(s, key)}): {msg}")

    if c.chunk_size <= 0:
        raise err("chunk_size", f"must be a positive number of tokens, got {c.chunk_size}")
    for key in ("max_local_cpu_size", "max_local_disk_size"):
        if getattr(c, key) < 0:
            raise err(key, f"must be >= 0 GB, got {getattr(c, key)}")
    if c.local_disk and c.max_local_disk_size <= 0:
        raise err("max_local_disk_size", "local_disk is set but its size is 0: set max_local_disk_size in GB")
    if c.remote_url is not None:
        scheme, sep, rest = c.remote_url.partition("://")
        if not sep or not rest:
            raise err("remote_url", f"{redact_url(c.remote_url)!r} is not scheme://host:port (e.g. "
                      "redis://localhost:6379)")
        if scheme not in REMOTE_SCHEMES + LMCACHE_ONLY_SCHEMES:
            raise err("remote_url", f"scheme {scheme!r} is not one of "
                      f"{', '.join(REMOTE_SCHEMES + LMCACHE_ONLY_SCHEMES)}")
    if c.remote_serde not in SERDES:
        raise err("remote_serde", f"{c.remote_serde!r} is not one of {', '.join(SERDES)}")
    lo, hi = CACHEGEN_BINS
    for key in ("cachegen_key_bins", "cachegen_value_bins"):
        bins = getattr(c, key)
        if len(bins) != 2 or not all(lo <= b <= hi for b in bins):
            raise err(key, f"{bins} is not two bin counts from {lo} to {hi} ([first layers, the rest]; 16 is "
                           "4 bits a value, 32 is 5)")
    for key in ("pd_handshake_timeout", "pd_alloc_timeout", "pd_lease_seconds", "pd_kv_ready_timeout",
                "pd_queue_seconds", "blocking_timeout_secs", "lmcache_worker_heartbeat_time",
                "lmcache_worker_heartbeat_timeout"):
        if getattr(c, key) <= 0:
            raise err(key, f"must be a positive number of seconds, got {getattr(c, key)}")
    if c.pd_kv_timeout_action not in ("recompute", "fail"):
        raise err("pd_kv_timeout_action", f"{c.pd_kv_timeout_action!r} is not 'recompute' or 'fail'")
    if c.otlp_traces_protocol is not None and c.otlp_traces_protocol not in ("grpc", "http/protobuf"):
        raise err("otlp_traces_protocol", f"{c.otlp_traces_protocol!r} is not 'grpc' or 'http/protobuf'")
    if c.pd_chunk_format not in get_args(ChunkFormat):
        raise err("pd_chunk_format", f"{c.pd_chunk_format!r} is not 'block' or 'token'")
    for key in ("pd_peer_init_port", "pd_peer_alloc_port", "pd_proxy_port", "p2p_init_ports",
                "p2p_lookup_ports", "lmcache_worker_ports"):
        for port in c.ports(key):
            if not 0 < port < 65536:
                raise err(key, f"port {port} is outside 1-65535")

    try:
        secret.load(c.cluster_secret, c.cluster_secret_file)
    except secret.SecretError as e:
        key = "cluster_secret_file" if c.cluster_secret_file and not c.cluster_secret else "cluster_secret"
        raise err(key, str(e).split(": ", 1)[-1]) from None

    if c.transfer_channel is not None and c.transfer_channel != "nixl":
        raise err("transfer_channel", f"{c.transfer_channel!r} is not supported: use 'nixl'")
    if c.pd_role is not None and c.pd_role not in ("sender", "receiver"):
        raise err("pd_role", f"{c.pd_role!r} is not 'sender' (prefiller) or 'receiver' (decoder)")
    if c.enable_pd:
        if c.pd_role is None:
            raise err("pd_role", "enable_pd is true but pd_role is not set: set pd_role to 'sender' "
                      "(prefiller) or 'receiver' (decoder)")
        if c.pd_buffer_size <= 0:
            raise err("pd_buffer_size", f"must be a positive number of bytes, got {c.pd_buffer_size}")
        dev = c.pd_buffer_device
        if dev is not None and not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise err("pd_buffer_device", f"{dev!r} is not 'cpu', 'cuda' or 'cuda:N'")
        if c.pd_role == "receiver":
            for key in ("pd_peer_host", "pd_peer_init_port", "pd_peer_alloc_port"):
                if getattr(c, key) is None:
                    raise err(key, "pd_role is 'receiver' but this key is not set: the decoder needs "
                              "pd_peer_host, pd_peer_init_port and pd_peer_alloc_port to listen on")
            if len(c.ports("pd_peer_init_port")) != len(c.ports("pd_peer_alloc_port")):
                raise err("pd_peer_alloc_port", "needs as many ports as pd_peer_init_port (one per TP rank)")
    elif c.pd_role is not None:
        raise err("enable_pd", f"pd_role is {c.pd_role!r} but enable_pd is false: set enable_pd: true "
                  "or remove pd_role")

    if c.enable_p2p:
        if not c.enable_controller:
            raise err("enable_controller", "enable_p2p needs the controller: set enable_controller: true")
        for key in ("p2p_host", "p2p_init_ports", "p2p_lookup_ports"):
            if getattr(c, key) is None:
                raise err(key, "enable_p2p is true but this key is not set")
        if not c.local_cpu or c.max_local_cpu_size <= 0:
            raise err("local_cpu", "enable_p2p shares the local CPU tier: set local_cpu: true and "
                      "max_local_cpu_size > 0")
        if not c.controller_reply_url:
            raise err("controller_reply_url", "enable_p2p asks the controller who holds a prompt: set "
                      "controller_reply_url (e.g. localhost:8400)")
        n = len(c.ports("p2p_init_ports"))
        for key in ("p2p_lookup_ports", "lmcache_worker_ports"):
            if len(c.ports(key)) != n:
                raise err(key, f"lists {len(c.ports(key))} ports and p2p_init_ports {n}: give one of each "
                          "per TP rank")
    if c.enable_controller:
        if not (c.controller_pull_url or c.controller_url):
            raise err("controller_pull_url", "enable_controller is true but no controller address is "
                      "set: set controller_pull_url (e.g. localhost:8300)")
        if c.lmcache_worker_ports is None:
            raise err("lmcache_worker_ports", "enable_controller is true but the worker port is not set")
    for key in ("pd_peer_advertise_host", "p2p_advertise_host"):
        v = getattr(c, key)
        if v is not None and (v.strip("[]") in ("", "*", "0.0.0.0", "::") or any(ch in v for ch in "/ ,")):
            raise err(key, f"{v!r} is not an address peers can dial: give this machine's address or name "
                      "(0.0.0.0 and :: go in the bind key)")
    for key in ("kv_events_relay_port", "kv_events_relay_replay_port"):
        v = getattr(c, key)
        if v is not None and not 0 < v < 65536:
            raise err(key, f"{v} is not a port number (1-65535)")
    if c.kv_events_relay_replay_port is not None and c.kv_events_relay_port is None:
        raise err("kv_events_relay_port", "kv_events_relay_replay_port is set without it: set both (the relay's "
                  "event port and its replay port)")
    if c.enable_controller and not c.enable_p2p:
        raise err("enable_p2p", "kvferry's controller coordinates P2P sharing: set enable_p2p: true with "
                  "p2p_host, p2p_init_ports and p2p_lookup_ports (or enable_controller: false)")
