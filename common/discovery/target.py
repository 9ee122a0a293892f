"""A --discovery value: which engine, where, and with what credentials (docs/deploy.md "Discovery").

``etcd://HOST:PORT[/PREFIX][?QUERY]`` (``etcds://`` for TLS), ``file://PATH`` or
``k8s://NAMESPACE[?QUERY]``. The query holds etcd's own security and the clock allowance, so one
string serves the proxy's ``--discovery``, ``kvferry join --discovery`` and ``kvferry up
--discovery`` alike:

- ``cacert=FILE``: the CA that signed etcd's server certificate (else the system's);
  ``cert=FILE&key=FILE``: a client certificate for an etcd with ``--client-cert-auth``.
- ``user=NAME&password_file=FILE``: an etcd user, and the file (mode 600) holding its password;
  never the password itself (a command line and log lines show the URL).
- ``clock_skew=SECONDS``: how far apart the machines' clocks may be (a record counts until its
  signed expiry plus this; default 1).

``k8s://NAMESPACE`` (proxies only: Kubernetes registers the pods) takes its own query
(common/discovery/pods.py says what makes a pod an instance):

- ``selector=LABELS``: the pods' label selector, URL-encoded (default ``app.kubernetes.io/part-of=kvferry``);
- ``kubeconfig=FILE`` and ``context=NAME``: a kubeconfig (else in a pod its ServiceAccount, else
  ``$KUBECONFIG`` or ``~/.kube/config``); ``serviceaccount=DIR``: where a pod's token and CA are
  mounted, when not at the usual place;
- ``resync=SECONDS``: how often the pods are listed whole again (default 30).
"""

from __future__ import annotations

import math
import os
import re
import ssl
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from kvferry.common.discovery.etcd import Etcd
from kvferry.common.errors import ConfigurationError
from kvferry.common.password_file import PasswordFileError, read_password_file

DEFAULT_PREFIX = "/kvferry"
DEFAULT_CLOCK_SKEW_S = 1.0
QUERY_KEYS = ("cacert", "cert", "key", "user", "password_file", "clock_skew")
K8S_QUERY_KEYS = ("selector", "kubeconfig", "context", "serviceaccount", "resync")
DEFAULT_SELECTOR = "app.kubernetes.io/part-of=kvferry"
DEFAULT_RESYNC_S = 30.0
SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# A namespace is a DNS label (RFC 1123).
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class DiscoveryError(ConfigurationError, ValueError):
    """A bad --discovery value; the message names it and the fix."""


class ReadOnlyDiscovery(DiscoveryError):
    """A change kvferry does not write to this discovery (Kubernetes: the pods are the records);
    the message names the command that makes it."""


@dataclass(frozen=True)
class Target:
    """A parsed --discovery value."""

    scheme: str  # "etcd" | "file" | "k8s"
    endpoint: str = ""  # etcd: http://host:port (https:// for etcds://)
    prefix: str = DEFAULT_PREFIX  # etcd: the cluster's key prefix, no trailing slash
    path: str = ""  # file: the watched file
    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = field(default="", repr=False)
    clock_skew: float = DEFAULT_CLOCK_SKEW_S
    namespace: str = ""  # k8s: the pods' namespace
    selector: str = DEFAULT_SELECTOR  # k8s: their label selector
    kubeconfig: str = ""  # k8s: "" is in-cluster, else $KUBECONFIG or ~/.kube/config
    context: str = ""
    serviceaccount: str = SERVICEACCOUNT_DIR
    resync: float = DEFAULT_RESYNC_S

    @property
    def host(self) -> str:
        return (urlsplit(self.endpoint).hostname or "") if self.scheme == "etcd" else ""

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        if self.scheme == "k8s":
            return f"k8s://{self.namespace} (pods {self.selector})"
        scheme = "etcds" if self.endpoint.startswith("https") else "etcd"
        return f"{scheme}://{self.endpoint.split('://', 1)[1]}{self.prefix}" + (f" as {self.user}" if self.user else "")

    def tls(self) -> ssl.SSLContext | None:
        """The TLS context etcds:// connects with (None for etcd://)."""
        if not self.endpoint.startswith("https"):
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.cacert or None)
        except (ssl.SSLError, OSError) as e:
            raise DiscoveryError(f"--discovery cacert={self.cacert}: no usable CA certificate there ({e}): name the "
                                 "PEM file of the CA that signed etcd's server certificate") from None
        if self.cert:
            try:
                ctx.load_cert_chain(self.cert, self.key)
            except (ssl.SSLError, OSError) as e:
                raise DiscoveryError(f"--discovery cert={self.cert} key={self.key}: not a client certificate and its "
                                     f"private key ({e}): name the PEM files etcd's CA signed") from None
        return ctx


def connect(target: Target, timeout: float) -> Etcd:
    """A client for `target`'s etcd, with its TLS and user."""
    return Etcd(target.endpoint, timeout, tls=target.tls(), client_cert=bool(target.cert), user=target.user,
                password=target.password)


def _credentials(flag: str, query: dict[str, str]) -> tuple[str, str]:
    user, path = query.get("user", ""), query.get("password_file", "")
    if bool(user) != bool(path):
        raise DiscoveryError(f"{flag}: user= and password_file= go together (an etcd user, and a file, mode 600, "
                             "holding its password)")
    if not user:
        return "", ""
    try:
        return user, read_password_file(path, f"{flag} password_file=")
    except PasswordFileError as e:
        raise DiscoveryError(str(e)) from None


def _file_query(flag: str, query: dict[str, str], name: str) -> str:
    path = query.get(name, "")
    if path and not os.access(path, os.R_OK):
        raise DiscoveryError(f"{flag}: {name}={path}: cannot be read: fix the path or its permissions")
    return os.path.abspath(path) if path else ""


def _query(flag: str, shown: str, raw: str, known: tuple[str, ...]) -> dict[str, str]:
    """The URL's query as a dict; DiscoveryError for a malformed, unknown or repeated key."""
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=bool(raw))
    except ValueError:
        raise DiscoveryError(f"{flag}: the query of {shown!r} is not NAME=VALUE&...") from None
    names = [k for k, _ in pairs]
    bad = sorted(set(names) - set(known)) + sorted({k for k in names if names.count(k) > 1})
    if bad:
        hint = ": the password goes in a file named by ?password_file=, never the URL" if "password" in bad else ""
        raise DiscoveryError(f"{flag}: ?{bad[0]}= in {shown!r} is unknown or repeated (known: "
                             f"{', '.join(known)}){hint}")
    return dict(pairs)


def _seconds(flag: str, query: dict[str, str], name: str, default: float, low: float) -> float:
    try:
        value = float(query.get(name, default))
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and low <= value <= 3600):
        raise DiscoveryError(f"{flag}: {name}={query[name]}: expected seconds from {low:g} to 3600")
    return value


def _k8s_target(raw: str, flag: str) -> Target:
    parts = urlsplit(raw)
    shown = raw.split("?", 1)[0]
    ns = parts.netloc
    if not _NAMESPACE.fullmatch(ns) or parts.path.strip("/"):
        raise DiscoveryError(f"{flag}: {shown!r} is not k8s://NAMESPACE (a namespace name: lowercase letters, "
                             "digits and '-', at most 63)")
    query = _query(flag, shown, parts.query, K8S_QUERY_KEYS)
    selector = query.get("selector", DEFAULT_SELECTOR).strip()
    if not selector or len(selector) > 4096:
        raise DiscoveryError(f"{flag}: selector= must name the instances' labels, e.g. "
                             f"selector={DEFAULT_SELECTOR} (URL-encode '=' as %3D where your shell needs it)")
    resync = _seconds(flag, query, "resync", DEFAULT_RESYNC_S, 1)
    kubeconfig = _file_query(flag, query, "kubeconfig")
    if query.get("context") and not kubeconfig:
        raise DiscoveryError(f"{flag}: context= picks a context of a kubeconfig: name it with kubeconfig=FILE")
    return Target("k8s", namespace=ns, selector=selector, kubeconfig=kubeconfig, context=query.get("context", ""),
                  serviceaccount=os.path.abspath(query["serviceaccount"]) if query.get("serviceaccount")
                  else SERVICEACCOUNT_DIR, resync=resync)


def parse_target(raw: str, flag: str = "--discovery") -> Target:
    """``etcd://HOST:PORT[/PREFIX][?QUERY]`` (``etcds://`` for TLS), ``file://PATH`` or
    ``k8s://NAMESPACE[?QUERY]``."""
    parts = urlsplit(raw)
    if parts.scheme == "file":
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        if not path:
            raise DiscoveryError(f"{flag}: {raw!r} names no file: file:///path/to/cluster.yaml")
        return Target("file", path=os.path.abspath(path))
    if parts.scheme == "k8s":
        return _k8s_target(raw, flag)
    if parts.scheme not in ("etcd", "etcds"):
        raise DiscoveryError(f"{flag}: {raw!r}: expected etcd://HOST:PORT/PREFIX, file://PATH or k8s://NAMESPACE")
    shown = raw.split("?", 1)[0]
    if parts.password is not None or parts.username is not None:
        raise DiscoveryError(f"{flag}: no user or password in the URL's address (a command line and log lines show "
                             f"it): give ?user=NAME&password_file=FILE (a file holding the password)")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise DiscoveryError(f"{flag}: {shown!r} is not etcd://HOST:PORT/PREFIX (etcd's client port, usually 2379)")
    query = _query(flag, shown, parts.query, QUERY_KEYS)
    tls = {k: _file_query(flag, query, k) for k in ("cacert", "cert", "key")}
    if parts.scheme == "etcd" and any(tls.values()):
        raise DiscoveryError(f"{flag}: cacert=, cert= and key= need TLS: write etcds://{shown.split('://', 1)[1]}")
    if bool(tls["cert"]) != bool(tls["key"]):
        raise DiscoveryError(f"{flag}: cert= and key= go together (a client certificate and its private key)")
    skew = _seconds(flag, query, "clock_skew", DEFAULT_CLOCK_SKEW_S, 0)
    user, password = _credentials(flag, query)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    prefix = "/" + parts.path.strip("/") if parts.path.strip("/") else DEFAULT_PREFIX
    target = Target("etcd", f"{'https' if parts.scheme == 'etcds' else 'http'}://{host}:{port}", prefix,
                    user=user, password=password, clock_skew=skew, cacert=tls["cacert"], cert=tls["cert"],
                    key=tls["key"])
    target.tls()  # a CA or client certificate that cannot be loaded fails here, naming the query key
    return target
