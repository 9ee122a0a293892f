"""Which browser requests an admin HTTP API refuses: the one rule of the proxy's /admin/* and the
controller's API.

A web page the operator opens can make the browser send requests to any address, loopback
included. It cannot read the answers (the same-origin policy), so what must be stopped is a
request that *changes* something, and a page that renames the server's address as its own:

- **Cross-site.** A request that changes state (any method but GET, HEAD, OPTIONS) is refused
  when the browser marks it as sent by a page of another origin: `Sec-Fetch-Site` other than
  `same-origin` or `none` (`same-site` included: another port on localhost, a sibling
  subdomain, is another origin too), or an `Origin` that is `null` or not the request's own
  `Host`. Every browser sends `Origin` on a request whose method is not GET or HEAD, form posts
  and text/plain bodies included, so this holds whatever the body's Content-Type says; clients
  that are not browsers (curl, scripts, SDKs) send neither header and pass.
- **DNS rebinding.** A page at `http://evil:9000` whose name is then resolved to 127.0.0.1 sends
  `Host: evil:9000` with `Origin: http://evil:9000`: same origin to the browser, and it may read
  the answers. So, where no key guards the API, a request whose `Host` is not a name the server
  answers to (`Hosts`: loopback's, the address it listens on, and `--allowed-host NAME`) is
  refused. Where a key guards it, a rebound page cannot send the key (the browser keeps
  credentials per origin), and any name may be used. The Host read is the request's one Host
  line (`one_host`): a request with two has no name this server answers to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvferry.common import netutil as net

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SAME = frozenset({"same-origin", "none"})  # Sec-Fetch-Site values of a request from the server's own page, or typed
DEFAULT_PORTS = {"http": "80", "https": "443"}

CROSS_SITE = ("cross-site request refused: a browser marked it as sent by a page of another origin (Origin, "
              "Sec-Fetch-Site); call this API from a client (curl, a script) or from its own page")


def host_name(value: str) -> str:
    """A Host header's name, or an --allowed-host value's: lower case, without port or IPv6 brackets."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        return v[1:end] if end > 0 else v
    name, sep, port = v.rpartition(":")
    if sep and ":" not in name and (port.isdigit() or not port):
        return name
    return v


def _authority(scheme: str, hostport: str) -> tuple[str, str]:
    """(name, port) of `host[:port]`, the scheme's default port filled in."""
    v = hostport.strip().lower()
    name = host_name(v)
    rest = v[v.find("]") + 1:] if v.startswith("[") else v[len(name):]
    port = rest[1:] if rest.startswith(":") and rest[1:] else DEFAULT_PORTS.get(scheme, "")
    return name, port


class Hosts:
    """The names a server answers to: localhost, any loopback address, the address it listens on
    (unless that is every interface) and the `extra` names (--allowed-host)."""

    def __init__(self, bind_host: str, extra: Iterable[str] = ()) -> None:
        names = {"localhost", *(host_name(x) for x in extra)}
        bound = host_name(bind_host) if net.unbracket(bind_host) not in net.WILDCARDS else ""
        if bound:
            names.add(bound)
        self.names = frozenset(names)

    def allows(self, header: str | None) -> bool:
        """Is this `Host` header one of the names? (A request without one comes from no browser;
        it is refused all the same: HTTP/1.1 requires Host.)"""
        if not header:
            return False
        name = host_name(header)
        return name in self.names or net.is_loopback(name)


def one_host(values: Sequence[str]) -> str | None:
    """The request's Host from its Host field lines: the one value, or None for none or several.
    Two lines are no name at all: a server and a proxy in front of it could each read another
    (RFC 9112 §3.2 answers such a request 400; a server that does not is still not fooled here)."""
    return values[0] if len(values) == 1 else None


def cross_site(origin: str | None, fetch_site: str | None, host: str | None) -> bool:
    """Did a browser send this request from a page of another origin than `host`'s?"""
    if fetch_site is not None and fetch_site.strip().lower() not in SAME:
        return True
    if origin is None:
        return False
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or not host or "/" in rest:
        return True  # "null" (a sandboxed or file: page, a redirect) or malformed
    return _authority(scheme, rest) != _authority(scheme, host)


def refusal(method: str, host: str | None, origin: str | None, fetch_site: str | None,
            hosts: Hosts | None) -> str | None:
    """Why a request to an admin API is refused (a message naming the fix), or None.
    `hosts`: the names the server answers to where no key guards the API, else None."""
    if hosts is not None and not hosts.allows(host):
        return (f"Host {host!r} is not a name this server answers to (a page that renamed its address, DNS "
                "rebinding, must not reach an API without a key): call it as localhost or its address, add "
                "--allowed-host NAME, or set --admin-key")
    if method not in SAFE_METHODS and cross_site(origin, fetch_site, host):
        return CROSS_SITE
    return None
