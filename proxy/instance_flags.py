"""The proxy's instance flags: LMCache's --prefiller-host/--prefiller-port and --decoder-host/
--decoder-port lists (with the decoders' receiver ports and hosts), repeatable instance URLs, and
--kv-events. Every mistake is one line naming the flag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvferry.common import netutil as net
from kvferry.common.errors import ConfigurationError


class OptionError(ConfigurationError, ValueError):
    """A bad flag or config entry; the message names it."""


@dataclass(frozen=True)
class InstanceSpec:
    role: str  # "prefiller" | "decoder"
    url: str  # http://host:port
    init_port: int | None = None  # decoder: receiver init port (one per TP rank: the first)
    alloc_port: int | None = None
    init_ports: tuple[int, ...] = ()
    alloc_ports: tuple[int, ...] = ()
    # decoder: the address prefillers dial for its receiver (pd_peer_advertise_host); unset: the
    # URL's host (LMCache's convention: receiver and HTTP server on one address)
    receiver_host: str | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def kv_host(self) -> str:
        """Where the decoder's receiver is dialled: its advertised host, else the URL's."""
        return self.receiver_host or self.host


def csv_values(flag: str, value: str | None, kind=str) -> list:
    if value is None:
        return []
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    try:
        return [kind(v) for v in items]
    except ValueError:
        raise OptionError(f"{flag}: expected a comma-separated list of {kind.__name__}s, got {value!r}") from None


def port_number(flag: str, p: int) -> int:
    if not 0 < p < 65536:
        raise OptionError(f"{flag}: {p} is not a port number (1-65535)")
    return p


def _expand(flag: str, hosts: list[str], ports: list[int], count: int | None) -> list[tuple[str, int]]:
    """LMCache's convention: lists pair up; one host and one port with a count mean consecutive ports."""
    if not ports:
        if hosts or count is not None:
            raise OptionError(f"--{flag}-port is required with --{flag}-host / --num-{flag}s")
        return []
    for p in ports:
        port_number(f"--{flag}-port", p)
    hosts = hosts or ["localhost"]
    if count is not None and count < 1:
        raise OptionError(f"--num-{flag}s must be at least 1, got {count}")
    n = count if count is not None else max(len(hosts), len(ports))
    if len(ports) == 1 and n > 1:
        ports = [ports[0] + i for i in range(n)]
    if len(hosts) == 1 and n > 1:
        hosts = hosts * n
    if len(ports) != n or len(hosts) != n:
        raise OptionError(f"--{flag}-host/--{flag}-port: {len(hosts)} hosts and {len(ports)} ports for "
                          f"--num-{flag}s {n}: give one of each per instance, or one host and the first port")
    return list(zip(hosts, ports, strict=True))


def parse_url(flag: str, raw: str) -> str:
    u = raw if "://" in raw else f"http://{raw}"
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise OptionError(f"{flag}: {raw!r} is not http://host:port")
    return f"{parts.scheme}://{net.hostport(parts.hostname, parts.port)}"


def receiver_host(flag: str, raw: str) -> str:
    """A receiver's advertised host as given: an address or name, IPv6 with or without brackets."""
    host = net.unbracket(raw.strip())
    if not host or host in net.WILDCARDS or any(c in host for c in "/@ ,"):
        raise OptionError(f"{flag}: {raw!r} is not the address prefillers dial (a host name or an IP address; "
                          "not 0.0.0.0 or ::)")
    return host


def decoder_from(flag: str, raw: str) -> InstanceSpec:
    """`URL[,init_port,alloc_port[,receiver_host]]` (init/alloc may be `a+b` lists for TP ranks;
    receiver_host: the receiver's advertised address, when it is not the URL's host)."""
    url, *ports = [p.strip() for p in raw.split(",")]
    host = receiver_host(flag, ports.pop()) if len(ports) == 3 else None
    if len(ports) not in (0, 2):
        raise OptionError(f"{flag}: expected URL or URL,init_port,alloc_port[,receiver_host], got {raw!r}")
    if not ports:
        return InstanceSpec("decoder", parse_url(flag, url))
    try:
        init = tuple(port_number(flag, int(p)) for p in ports[0].split("+"))
        alloc = tuple(port_number(flag, int(p)) for p in ports[1].split("+"))
    except ValueError:
        raise OptionError(f"{flag}: ports must be numbers, got {raw!r}") from None
    if len(init) != len(alloc):
        raise OptionError(f"{flag}: as many init ports as alloc ports (one per TP rank), got {raw!r}")
    return InstanceSpec("decoder", parse_url(flag, url), init[0], alloc[0], init, alloc, host)


def prefillers(vals: dict) -> list[InstanceSpec]:
    pf = _expand("prefiller", csv_values("--prefiller-host", vals.get("prefiller_host")),
                 csv_values("--prefiller-port", vals.get("prefiller_port"), int), vals.get("num_prefillers"))
    out = [InstanceSpec("prefiller", parse_url("--prefiller-host", net.hostport(h, p))) for h, p in pf]
    out += [InstanceSpec("prefiller", parse_url("--prefiller", u)) for u in flag_list(vals.get("prefiller"))]
    return out


def decoders(vals: dict) -> list[InstanceSpec]:
    """LMCache's --decoder-host/--decoder-port style, with their receivers' ports and hosts."""
    dc = _expand("decoder", csv_values("--decoder-host", vals.get("decoder_host")),
                 csv_values("--decoder-port", vals.get("decoder_port"), int), vals.get("num_decoders"))
    if dc:
        init = csv_values("--decoder-init-port", vals.get("decoder_init_port"), int)
        alloc = csv_values("--decoder-alloc-port", vals.get("decoder_alloc_port"), int)
        for flag, ports in (("--decoder-init-port", init), ("--decoder-alloc-port", alloc)):
            if not ports:
                raise OptionError(f"{flag} is required with --decoder-host/--decoder-port: the decoders' "
                                  "receiver ports (pd_peer_init_port / pd_peer_alloc_port of their configs)")
            if len(ports) == 1 and len(dc) > 1:
                ports[:] = [ports[0] + i for i in range(len(dc))]
            if len(ports) != len(dc):
                raise OptionError(f"{flag}: {len(ports)} ports for {len(dc)} decoders")
            for p in ports:
                port_number(flag, p)
        rh = [receiver_host("--decoder-receiver-host", h) for h in csv_values("--decoder-receiver-host",
                                                                        vals.get("decoder_receiver_host"))]
        if len(rh) == 1:
            rh *= len(dc)
        if rh and len(rh) != len(dc):
            raise OptionError(f"--decoder-receiver-host: {len(rh)} hosts for {len(dc)} decoders: give one per "
                              "decoder, or one for all")
        return [InstanceSpec("decoder", parse_url("--decoder-host", net.hostport(h, p)), i, a, (i,), (a,),
                             rh[n] if rh else None)
                for n, ((h, p), i, a) in enumerate(zip(dc, init, alloc, strict=True))]
    if vals.get("decoder_receiver_host"):
        raise OptionError("--decoder-receiver-host goes with --decoder-host/--decoder-port (with --decoder, "
                          "give URL,init_port,alloc_port,receiver_host)")
    return []


def instances(o: Any, vals: dict) -> None:
    """--decoder URLs, the checks over every instance, and --kv-events."""
    o.decoders += [decoder_from("--decoder", d) for d in flag_list(vals.get("decoder"))]
    if not o.prefillers and o.discovery is None:
        raise OptionError("no prefiller: give --prefiller-host/--prefiller-port (or --prefiller URL), or "
                          "--discovery")
    if not o.decoders and o.discovery is None:
        raise OptionError("no decoder: give --decoder-host/--decoder-port with --decoder-init-port and "
                          "--decoder-alloc-port (or --decoder URL,init_port,alloc_port)")
    for d in o.decoders:
        if d.init_port is None:
            raise OptionError(f"--decoder {d.url}: its receiver ports are needed: URL,init_port,alloc_port")
    urls = {i.url for i in [*o.prefillers, *o.decoders]}
    for raw in flag_list(vals.get("kv_events")):
        url, ev = kv_events_from(raw)
        if url not in urls:
            raise OptionError(f"--kv-events {raw}: {url} is not a --prefiller or --decoder of this proxy")
        o.kv_events[url] = ev


def kv_events_from(raw: str) -> tuple[str, tuple[str, str | None]]:
    """`URL=ENDPOINT[,REPLAY]`: vLLM's --kv-events-config endpoint and replay_endpoint as the proxy
    reaches them (tcp://host:port or ipc://path; the proxy connects, vLLM binds)."""
    url, sep, rest = raw.partition("=")
    eps = [e.strip() for e in rest.split(",")] if sep else []
    if not eps or len(eps) > 2 or not all(e.startswith(("tcp://", "ipc://")) and "*" not in e for e in eps):
        raise OptionError(f"--kv-events: expected URL=tcp://host:port[,tcp://host:replay_port] (or ipc://path), "
                          f"got {raw!r}")
    return parse_url("--kv-events", url.strip()), (eps[0], eps[1] if len(eps) > 1 else None)


def flag_list(v) -> list[str]:
    if v is None:
        return []
    return [str(x) for x in v] if isinstance(v, list) else [str(v)]
