"""The proxy's command line: LMCache's disagg_proxy_server.py flags, plus repeatable instance URLs and
a YAML file. Every mistake is one line naming the flag."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import yaml

from kvferry.common import netutil as net
from kvferry.proxy.instance_flags import (
    InstanceSpec,
    OptionError,
    decoders,
    flag_list,
    instances,
    port_number,
    prefillers,
)


@dataclass
class ProxyOptions:
    host: str = "127.0.0.1"
    port: int = 9000
    prefillers: list[InstanceSpec] = field(default_factory=list)
    decoders: list[InstanceSpec] = field(default_factory=list)
    proxy_host: str | None = None  # where receivers PUSH "KV arrived" notifications
    proxy_port: int | None = None
    proxy_bind_host: str | None = None  # where the notify socket binds when not --proxy-host (e.g. 0.0.0.0)
    policy: str = "cache"  # "cache" (docs/proxy.md "Routing") | "load" (power of two choices) | "round_robin"
    affinity_header: str | None = None
    # Keys never appear in the repr (nor in a log line).
    api_key: str | None = field(default=None, repr=False)
    upstream_api_key: str | None = field(default=None, repr=False)
    admin: bool = True
    admin_key: str | None = field(default=None, repr=False)  # required on /admin/* when set; distinct from api_key
    allowed_host: list[str] = field(default_factory=list)  # the admin API's names without an admin key, beyond
    # loopback's and --host's (DNS rebinding: common/http/guard.py)
    cluster_secret_file: str | None = None  # else env KVFERRY_CLUSTER_SECRET / KVFERRY_CLUSTER_SECRET_FILE
    require_cluster_secret: bool = False  # an unprotected port beyond loopback is a start-up error
    connect_timeout: float = 5.0
    read_timeout: float = 600.0
    health_interval: float = 5.0
    log_level: str = "info"
    workers: int = 0  # processes serving --port (proxy/multiproc/supervisor.py); parse() sets it (0: not yet resolved)
    # Front-door limits (docs/proxy.md): each answered with an OpenAI-shaped JSON error.
    max_body_bytes: int = 64 << 20  # a larger body gets 413 before it is read
    max_batch_prompts: int = 256  # prompts in one /v1/completions list; each is two upstream requests
    max_in_flight: int = 1024  # client requests handled at once; more get 503 with Retry-After
    max_n: int = 16  # samples per request (n): each is its own pair of legs
    upstream_connections: int = 512  # open connections per instance (http_client.Pool; 0 was unbounded)
    request_timeout: float = 30.0  # a request's head and body must arrive within this of its first byte
    keep_alive_timeout: float = 75.0  # an idle keep-alive connection closes after this (front_door.IDLE_S)
    max_connections: int | None = None  # client connections per process (None: from `ulimit -n`, http_conns)
    # Cache-aware routing (docs/proxy.md "Routing").
    kv_events: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # url -> (endpoint, replay)
    tokenizer: str | None = None  # the model's tokenizer: predicts a text prompt's tokens before routing
    local_prefill_tokens: int = 0  # the decoder prefills a prompt whose uncached part is at most this (0: off)
    local_prefill_fraction: float = 0.9  # ... or whose cached part on the decoder is at least this (> 1: off)
    load_tokens_per_request: int = 128  # the cost of one request in flight on a prefiller, in prompt tokens
    kv_events_stale_after: float = 10.0  # an event stream silent this long (probes unanswered) is ignored
    prefix_index_max_blocks: int = 200_000  # per instance; least recently used blocks are forgotten first
    # Discovery (docs/deploy.md "Discovery"): instances from etcd or a watched file, beside the static ones.
    discovery: str | None = None  # etcd://HOST:PORT/PREFIX | file://PATH | k8s://NAMESPACE
    discovery_model: str | None = None  # use only instances serving this model (default: the first seen)
    discovery_fingerprint: str | None = None  # ... with this layout fingerprint (default: the first seen)
    insecure_discovery: bool = False  # discovery beyond loopback without a cluster secret (not recommended)
    load_interval: float | None = None  # seconds between /metrics scrapes of every engine (None: 0.5 with
    # discovery, off without; 0: off)
    # Failures mid-request (docs/proxy.md "Failures"): a decode stream silent this long counts as failed,
    # and a request moves to another decoder at most this many times.
    stall_timeout: float = 60.0
    max_migrations: int = 2
    # Who computes the answer's first token (docs/proxy.md "First token"): "prefiller" (its token goes
    # to the client at once; the legs carry token ids) or "decoder" (as vLLM's own PD routers do).
    first_token: str = "prefiller"
    # Traces (docs/observability.md "Traces"): off without an endpoint.
    otlp_traces_endpoint: str | None = None  # OTLP collector; grpc: http://HOST:4317, http/protobuf: .../v1/traces
    otlp_traces_protocol: str | None = None  # "grpc" | "http/protobuf" (None: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc)
    trace_sample_ratio: float = 1.0  # of the requests traced (with a client's traceparent too, unless trusted)
    trust_client_trace_sampling: bool = False  # a client's sampled flag decides (docs/security.md "HTTP/1.1's rules")
    service_name: str = "kvferry-proxy"

    @property
    def legs_carry_ids(self) -> bool:
        """--first-token prefiller: both legs carry token ids (the decoder continues after the prefiller's token)."""
        return self.first_token == "prefiller"


def allowed_host(raw: str) -> str:
    """An --allowed-host NAME: a host name or address (IPv6 with or without brackets), no port."""
    host = net.unbracket(raw.strip())
    if not host or host in net.WILDCARDS or (any(c in host for c in "/@ ,:") and not net.is_ipv6(host)):
        raise OptionError(f"--allowed-host: {raw!r} is not a host name or address (e.g. proxy.internal, 10.0.0.5)")
    return host


POLICIES = ("cache", "load", "round_robin")
PROTOCOLS = ("grpc", "http/protobuf")  # common/otel.py's
FIRST_TOKEN = ("prefiller", "decoder")


@dataclass(frozen=True)
class Opt:
    """One option, declared once: its flag (`--` + name with dashes), YAML key (name), help, and
    what values it takes. kind "str", "port", "positive" (a float > 0), "count" (an int >= 0),
    "size" (an int >= 1) and "flag" are converted and checked here into ProxyOptions' field of
    the same name; "raw" values (instance lists, secrets) are read by parse() itself."""

    name: str
    kind: str
    help: str | None = None
    arg: dict = field(default_factory=dict)  # more argparse keywords (type, choices, metavar, action)


OPTIONS: tuple[Opt, ...] = (
    Opt("host", "str", "bind address (default 127.0.0.1)"),
    Opt("port", "port", "listen port (default 9000)"),
    Opt("prefiller_host", "raw", "comma-separated hosts (LMCache flag)"),
    Opt("prefiller_port", "raw", "comma-separated ports, or the first of consecutive ports"),
    Opt("num_prefillers", "raw", arg={"type": int}),
    Opt("decoder_host", "raw"),
    Opt("decoder_port", "raw"),
    Opt("decoder_init_port", "raw", "receiver init ports, one per decoder"),
    Opt("decoder_alloc_port", "raw", "receiver alloc ports, one per decoder"),
    Opt("num_decoders", "raw", arg={"type": int}),
    Opt("decoder_receiver_host", "raw",
        "the address prefillers dial for each decoder's receiver (its pd_peer_advertise_host), one per "
        "decoder or one for all; default: the decoder's --decoder-host"),
    Opt("proxy_host", "str", "where decoders' receivers send KV-arrived notifications"),
    Opt("proxy_port", "port"),
    Opt("proxy_bind_host", "str", "bind the notification socket here (e.g. 0.0.0.0 or ::) while decoders send to "
                                  "--proxy-host (their pd_proxy_host); default: --proxy-host"),
    Opt("prefiller", "raw", "a prefiller (repeatable)", {"action": "append", "metavar": "URL"}),
    Opt("decoder", "raw", "a decoder (repeatable); RECEIVER_HOST: the address prefillers dial for its receiver, "
                          "when it is not the URL's host",
        {"action": "append", "metavar": "URL[,INIT,ALLOC[,RECEIVER_HOST]]"}),
    Opt("policy", "str", "cache (default: fewest uncached + queued tokens, from the engines' KV events), load, "
                         "round_robin", {"choices": POLICIES}),
    Opt("kv_events", "raw", "an instance's vLLM KV event publisher (--kv-events-config endpoint, replay "
                            "endpoint); repeatable", {"action": "append", "metavar": "URL=ENDPOINT[,REPLAY]"}),
    Opt("tokenizer", "str", "the model's tokenizer (path or name): text prompts' tokens for routing"),
    Opt("local_prefill_tokens", "count", "the decoder prefills a prompt itself when at most this many of its "
                                         "tokens are uncached there (default 0: off)"),
    Opt("local_prefill_fraction", "positive", "... or when the decoder holds at least this fraction of the prompt "
                                              "(default 0.9; above 1: off)"),
    Opt("load_tokens_per_request", "count", "the cache policy's load term: prompt tokens one in-flight request "
                                            "costs (default 128)"),
    Opt("kv_events_stale_after", "positive", "seconds without an answer from an event publisher before its "
                                             "instance is routed by load (default 10)"),
    Opt("prefix_index_max_blocks", "size", "blocks remembered per instance (default 200000)"),
    Opt("affinity_header", "str", "route requests with the same header value to the same instances"),
    Opt("api_key", "str", "require 'Authorization: Bearer KEY' from clients"),
    Opt("upstream_api_key", "str", "Authorization sent to the vLLM instances"),
    Opt("connect_timeout", "positive"),
    Opt("read_timeout", "positive"),
    Opt("health_interval", "positive"),
    Opt("no_admin", "flag", "disable the /admin API"),
    Opt("admin_key", "raw", "require 'Authorization: Bearer KEY' on /admin/* (env KVFERRY_ADMIN_KEY); must differ "
                            "from --api-key. Without it the admin API is open on loopback only, and closed when "
                            "--api-key is set (a client key never opens it)"),
    Opt("allowed_host", "raw", "a name the admin API answers to without --admin-key, besides localhost, loopback "
                               "addresses and --host; repeatable (a request with another Host is refused: DNS "
                               "rebinding)", {"action": "append", "metavar": "NAME"}),
    Opt("cluster_secret_file", "raw", "the cluster secret for the proxy's ZMQ sockets (--proxy-port, aborts to "
                                      "decoders); else env KVFERRY_CLUSTER_SECRET[_FILE]"),
    Opt("require_cluster_secret", "flag", "refuse to start with --proxy-port or a tcp:// --kv-events beyond "
                                          "loopback and no cluster secret (default: a warning; the admin API beyond "
                                          "loopback without --admin-key is always refused)"),
    Opt("max_body_bytes", "size", "largest request body in bytes (default 64 MiB); more gets a JSON 413"),
    Opt("max_batch_prompts", "size", "most prompts in one /v1/completions list (default 256)"),
    Opt("max_in_flight", "size", "client requests handled at once (default 1024); more get 503 with Retry-After"),
    Opt("max_n", "size", "largest n (samples per request) accepted (default 16)"),
    Opt("upstream_connections", "size", "connections the proxy opens to each instance (default 512); more "
                                        "requests wait for one"),
    Opt("request_timeout", "positive", "seconds a request's head and body may take to arrive from its first byte; "
                                       "then its connection is closed (default 30)"),
    Opt("keep_alive_timeout", "raw", "seconds an idle keep-alive client connection waits for its next request "
                                     "before it is closed (default 75)"),
    Opt("max_connections", "size", "client connections open at once, per process; one more is answered 503 with "
                                   "Retry-After and closed (default: half of `ulimit -n` beyond 64, after raising "
                                   "it toward the hard limit)"),
    Opt("discovery", "str", "watch instances registered in etcd (kvferry join), listed in a YAML/JSON file, or "
                            "the pods a label selector picks in a Kubernetes namespace; etcds:// for TLS, and "
                            "?cacert=&cert=&key= (a client certificate), ?user=&password_file= (an etcd user) for "
                            "etcd's own security; k8s:// takes ?selector=&kubeconfig=&context=&resync= "
                            "(docs/deploy.md)",
        {"metavar": "etcd://HOST:PORT/PREFIX|file://PATH|k8s://NAMESPACE"}),
    Opt("discovery_model", "str", "with --discovery: use only instances serving this model name (default: the "
                                  "model of the first instance seen)"),
    Opt("discovery_fingerprint", "str", "with --discovery: use only instances with this KV layout fingerprint "
                                        "(default: the first instance's)"),
    Opt("insecure_discovery", "flag", "allow --discovery beyond loopback without a cluster secret (anyone who can "
                                      "write to etcd can then register a decoder that receives prompts)"),
    Opt("load_interval", "raw", "seconds between scrapes of every engine's /metrics (running + waiting requests: "
                                "load that every proxy sees); default 0.5 with --discovery, 0 (off) without",
        {"type": float}),
    Opt("stall_timeout", "positive", "seconds a decode stream may send nothing before it counts as failed and "
                                     "moves to another decoder, and a client may read nothing of its answer "
                                     "before it is cut off (default 60)"),
    Opt("max_migrations", "count", "how many times one request may move to another decoder after its stream broke "
                                   "(default 2; 0: never)"),
    Opt("first_token", "str", "prefiller (default: the prefiller's token reaches the client at once; both legs "
                              "carry token ids, so a broken decode stream goes on elsewhere) or decoder (the "
                              "decoder computes every token, as vLLM's PD routers do: no token ids on either leg, "
                              "first token later, no move mid-stream)", {"choices": FIRST_TOKEN}),
    Opt("otlp_traces_endpoint", "str", "send traces (OpenTelemetry, OTLP) here, e.g. http://127.0.0.1:4317 "
                                       "(grpc) or http://127.0.0.1:4318/v1/traces (http/protobuf); default: off",
        {"metavar": "URL"}),
    Opt("otlp_traces_protocol", "str", "grpc (default, as vLLM's --otlp-traces-endpoint) or http/protobuf; "
                                       "default: env OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else grpc",
        {"choices": PROTOCOLS}),
    Opt("trace_sample_ratio", "raw", "fraction of the requests whose traces are recorded (default 1); a client's "
                                     "traceparent keeps its trace id, and its sampled flag only with "
                                     "--trust-client-trace-sampling", {"type": float}),
    Opt("trust_client_trace_sampling", "flag", "follow a client traceparent's sampled flag instead of "
                                               "--trace-sample-ratio (default: off, so no client can make the "
                                               "proxy and both engines trace its requests)"),
    Opt("service_name", "str", "the proxy's service.name in its traces (default kvferry-proxy)"),
    Opt("workers", "size", "processes serving --port, routing as one proxy (default: the cores available; 1 "
                           "with --proxy-port, whose notification socket is one process's, or --discovery)"),
    Opt("log_level", "str"),
)
_BY_NAME = {opt.name: opt for opt in OPTIONS}
_ARG_TYPE = {"port": int, "positive": float, "count": int, "size": int}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvferry-proxy", description="OpenAI-compatible prefill/decode disaggregation proxy (kvferry).")
    ap.add_argument("--config", default=None, help="YAML file with any of these options (flags win)")
    for opt in OPTIONS:
        kw: dict = {"help": opt.help, **opt.arg}
        if opt.kind == "flag":
            kw["action"] = "store_true"
        elif kw.get("action") == "append":
            kw["default"] = []
        else:
            kw.setdefault("default", None)
            if opt.kind in _ARG_TYPE:
                kw.setdefault("type", _ARG_TYPE[opt.kind])
        ap.add_argument("--" + opt.name.replace("_", "-"), **kw)
    return ap


def _number(opt: Opt, raw: object, kind: type, what: str) -> float:
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise OptionError(f"--{opt.name.replace('_', '-')} must be {what}, got {raw!r}") from None


def _convert(opt: Opt, raw: object) -> object:
    """An option's value from a flag or the YAML file, checked; an OptionError names the flag."""
    flag = "--" + opt.name.replace("_", "-")
    if opt.kind == "str":
        return str(raw)
    if opt.kind == "port":
        return port_number(flag, int(_number(opt, raw, int, "a port number (1-65535)")))
    if opt.kind == "positive":
        v = _number(opt, raw, float, "a positive number")
        if v <= 0:
            raise OptionError(f"{flag} must be positive, got {v}")
        return v
    if opt.kind == "count":
        v = _number(opt, raw, int, "an integer")
        if v < 0:
            raise OptionError(f"{flag} must be 0 or more, got {v}")
        return v
    if opt.kind == "size":
        v = _number(opt, raw, int, "a positive integer")
        if v < 1:
            raise OptionError(f"{flag} must be a positive integer, got {v}")
        return v
    if opt.kind == "flag":
        if not isinstance(raw, bool):
            raise OptionError(f"--config: {opt.name} must be true or false, got {raw!r}")
        return raw
    raise AssertionError(opt.kind)


def parse(argv: list[str] | None = None) -> ProxyOptions:
    ns = parser().parse_args(argv)
    vals = _values(ns)
    o = _settings(vals)
    o.prefillers = prefillers(vals)
    o.decoders = decoders(vals)
    instances(o, vals)
    return o


def _values(ns: argparse.Namespace) -> dict:
    """The flags given, over the --config file's values."""
    vals = {k: v for k, v in vars(ns).items() if v is not None and v is not False and v != []}
    if ns.config:
        try:
            with open(ns.config) as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise OptionError(f"--config {ns.config}: {e}") from None
        if not isinstance(data, dict):
            raise OptionError(f"--config {ns.config}: expected a mapping of options")
        for k, v in data.items():
            key = str(k).replace("-", "_")
            if key not in _BY_NAME:
                raise OptionError(f"--config {ns.config}: unknown option {k!r}")
            if isinstance(v, list) and _BY_NAME[key].arg.get("action") != "append":
                v = ",".join(str(x) for x in v)
            vals.setdefault(key, v)
    return vals


def _settings(vals: dict) -> ProxyOptions:
    """Every option but the instances, converted and checked."""
    o = ProxyOptions()
    for opt in OPTIONS:
        if opt.kind != "raw" and opt.name in vals and opt.name != "no_admin":
            setattr(o, opt.name, _convert(opt, vals[opt.name]))
    o.admin = not _convert(_BY_NAME["no_admin"], vals.get("no_admin", False))
    if "load_interval" in vals:
        try:
            o.load_interval = float(vals["load_interval"])
        except (TypeError, ValueError):
            raise OptionError(f"--load-interval must be a number of seconds, got {vals['load_interval']!r}") from None
        if not 0 <= o.load_interval <= 3600:
            raise OptionError(f"--load-interval must be 0 (off) to 3600 seconds, got {o.load_interval}")
    if o.discovery is not None:
        from kvferry.common.discovery.sources import DiscoveryError, parse_target
        try:
            parse_target(o.discovery)
        except DiscoveryError as e:
            raise OptionError(str(e)) from None
    if "cluster_secret_file" in vals:
        o.cluster_secret_file = str(vals["cluster_secret_file"])
    o.allowed_host = [allowed_host(h) for h in flag_list(vals.get("allowed_host"))]
    admin_key = vals.get("admin_key", os.environ.get("KVFERRY_ADMIN_KEY") or None)
    if admin_key is not None:
        o.admin_key = str(admin_key).strip()
        if not o.admin_key:
            raise OptionError("--admin-key (or KVFERRY_ADMIN_KEY) is empty: give a key, or leave it unset")
        if o.api_key is not None and o.admin_key == o.api_key:
            raise OptionError("--admin-key must differ from --api-key: a client's key must not open the admin API")
    if o.workers == 0:  # one process where the workers would not see alike (docs/proxy.md "Workers")
        o.workers = 1 if o.proxy_port or o.discovery else len(os.sched_getaffinity(0))
    elif o.workers > 1 and o.proxy_port:
        raise OptionError(f"--workers {o.workers} with --proxy-port: the receivers' notifications arrive on one "
                          "socket, one process's; use --workers 1 with --proxy-port (or drop --proxy-port)")
    o.keep_alive_timeout = _keep_alive(vals.get("keep_alive_timeout", o.keep_alive_timeout))
    if o.policy not in POLICIES:
        raise OptionError(f"--policy: {o.policy!r} is not one of {', '.join(POLICIES)}")
    _tracing(o, vals)
    if o.first_token not in FIRST_TOKEN:
        raise OptionError(f"--first-token: {o.first_token!r} is not one of {', '.join(FIRST_TOKEN)}")
    return o


def _keep_alive(raw: object) -> float:
    """--keep-alive-timeout, checked: seconds, at least 0.1 (the connection sweep runs every quarter of it)."""
    try:
        v = float(str(raw))
    except ValueError:
        v = float("nan")
    if not v >= 0.1:  # NaN too
        raise OptionError(f"--keep-alive-timeout must be a number of seconds, 0.1 or more (how long an idle "
                          f"keep-alive connection is kept; default 75), got {raw!r}")
    return v


def _tracing(o: ProxyOptions, vals: dict) -> None:
    """--trace-sample-ratio and --otlp-traces-protocol, checked."""
    if "trace_sample_ratio" in vals:
        try:
            o.trace_sample_ratio = float(vals["trace_sample_ratio"])
        except (TypeError, ValueError):
            raise OptionError(f"--trace-sample-ratio must be a number from 0 to 1, got "
                              f"{vals['trace_sample_ratio']!r}") from None
        if not 0 <= o.trace_sample_ratio <= 1:
            raise OptionError(f"--trace-sample-ratio must be from 0 to 1, got {o.trace_sample_ratio}")
    if o.otlp_traces_protocol is not None and o.otlp_traces_protocol not in PROTOCOLS:
        raise OptionError(f"--otlp-traces-protocol: {o.otlp_traces_protocol!r} is not one of {', '.join(PROTOCOLS)}")
