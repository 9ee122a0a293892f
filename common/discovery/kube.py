"""A proxy's view of discovery from the Kubernetes API (``--discovery k8s://NAMESPACE``): list the
selected pods, then watch them from the list's resourceVersion; what makes a pod an instance is in
common/discovery/pods.py.

The failures other routers' users met, and what this does about each:

- a watch that ends, breaks or goes quiet (no byte, bookmarks included, for RESYNC + QUIET_S) is
  not resumed: the pods are listed whole again, so an event lost meanwhile (a DELETE while the
  watch was reconnecting) cannot leave a deleted pod routed;
- the watch is opened for `resync` seconds (``?resync=``, default 30) and then the pods are listed
  again: a watch that stays open yet silently stale is corrected within that period;
- ``410 Gone`` (the resourceVersion was compacted) lists again; bookmarks move the resourceVersion
  on while nothing changes;
- DELETED, a force deletion (no ``deletionTimestamp`` ever seen) and a pod relabelled out of the
  selector (the API server sends DELETED) all take the instance out at once;
- 401 and 403 are errors that name the credentials or the missing permission; the last good view
  stays in use and the proxy tries again (proxy/routing/membership.py).

State is bounded: at most MAX_PODS pods tracked (more are counted and ignored), a pod's JSON at
most MAX_EVENT_BYTES, a list page at most MAX_PAGE_BYTES, a bad pod logged once while it exists.

The official client (``kubernetes``) is synchronous (urllib3), so the list and watch run in one
thread per watcher; each view goes to the event loop with call_soon_threadsafe, only the newest
when several are waiting.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvferry.common.discovery.entries import Snapshot
from kvferry.common.discovery.pods import (
    BOOKMARK,
    EVENT,
    POD,
    POD_LIST,
    STATUS,
    NotInstance,
    Pod,
    Standing,
    role_of,
    standing,
)
from kvferry.common.discovery.target import DiscoveryError, Target
from kvferry.common.errors import UnavailableError
from kvferry.common.log import get_logger

logger = get_logger(__name__)

OnChange = Callable[[Snapshot], None]
OnReject = Callable[[str], None]

PAGE = 500  # pods per list page
MAX_PODS = 10_000
MAX_EVENT_BYTES = 4 << 20
MAX_PAGE_BYTES = 256 << 20
MAX_LOGGED = 256
QUIET_S = 10.0  # a watch silent this long past its own end is dropped and the pods listed again (default)
CONNECT_S = 5.0
MAX_TOKEN_BYTES = 64 << 10  # a projected ServiceAccount token is a JWT of a few KiB
TOKEN_REREAD_S = 60.0  # a ServiceAccount token is read again this long after its last read (kubelet rotates it)


def in_cluster(cfg: Any, folder: str) -> None:
    """Point `cfg` (a kubernetes.client.Configuration) at the API server a pod sees, with the
    ServiceAccount's token and CA from `folder`, as the client's load_incluster_config does (which
    reads only the default folder). The token is read again a minute after each read: kubelet
    rotates projected tokens."""
    from kubernetes import config
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise config.ConfigException("KUBERNETES_SERVICE_HOST or KUBERNETES_SERVICE_PORT is not set")
    token_file, ca_file = os.path.join(folder, "token"), os.path.join(folder, "ca.crt")
    if not os.path.isfile(ca_file) or os.path.getsize(ca_file) == 0:
        raise config.ConfigException(f"{ca_file} is missing or empty")
    read_at = [0.0]

    def read_token() -> str:
        with open(token_file, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
        token = raw.decode("ascii", "replace").strip()
        if not token or len(raw) > MAX_TOKEN_BYTES:
            raise config.ConfigException(f"{token_file} is empty or over {MAX_TOKEN_BYTES} bytes")
        return token

    def refresh(c: Any) -> None:
        """The client's hook before each request: a failed re-read (a rotation under way) keeps
        the token it has, so a call never fails on the file; the first read's failure is the caller's."""
        if time.monotonic() - read_at[0] < TOKEN_REREAD_S:
            return
        try:
            c.api_key["BearerToken"] = "bearer " + read_token()
        except (OSError, config.ConfigException) as e:
            logger.warning("discovery: the ServiceAccount token could not be read again (%s); keeping the last one", e)
        read_at[0] = time.monotonic()

    cfg.host = f"https://[{host}]:{port}" if ":" in host or "%" in host else f"https://{host}:{port}"
    cfg.ssl_ca_cert = ca_file
    cfg.api_key["BearerToken"], read_at[0] = "bearer " + read_token(), time.monotonic()
    cfg.refresh_api_key_hook = refresh


class _Gone(UnavailableError):
    """410: the resourceVersion (or a list's continue token) is compacted away: list again."""


def _status_message(body: object) -> str:
    """The message of a Kubernetes Status body (bounded), else the body's start."""
    raw = body.encode() if isinstance(body, str) else body if isinstance(body, bytes) else b""
    try:
        return STATUS.decode(raw[:65536]).message[:500]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return raw[:300].decode(errors="replace")


class KubeWatch:
    """Lists and watches the pods `target` selects; calls `on_change` (on the event loop) with the
    whole view whenever it changes. An API server that fails keeps the last view in use."""

    def __init__(self, target: Target, on_change: OnChange, on_reject: OnReject) -> None:
        assert target.scheme == "k8s"
        self.target, self.on_change, self.on_reject = target, on_change, on_reject
        self.pods: dict[str, Standing] = {}  # pod name -> what it says now
        self.resource_version = ""
        self.lists = 0  # full lists done (tests and the log read it)
        self._logged: set[tuple[str, str]] = set()  # (pod, reason) logged while the pod stays
        self._full = False
        self._last: Snapshot | None = None
        self._pending: Snapshot | None = None  # the newest view not yet handed to the loop
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._resp: Any = None  # the open watch (shut from the loop's thread on close)
        self._api: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.quiet_s = QUIET_S

    # ---- the client ----

    def _client(self) -> Any:
        from kubernetes import client, config
        t = self.target
        cfg = client.Configuration()
        try:
            if t.kubeconfig:
                config.load_kube_config(config_file=t.kubeconfig, context=t.context or None, client_configuration=cfg)
            elif os.environ.get("KUBERNETES_SERVICE_HOST"):
                in_cluster(cfg, t.serviceaccount)
            else:
                config.load_kube_config(client_configuration=cfg)
        except (config.ConfigException, OSError, ValueError, TypeError) as e:
            where = (f"kubeconfig {t.kubeconfig}" if t.kubeconfig else "the pod's ServiceAccount "
                     f"({t.serviceaccount})" if os.environ.get("KUBERNETES_SERVICE_HOST")
                     else "$KUBECONFIG or ~/.kube/config")
            raise DiscoveryError(f"--discovery {t}: no usable Kubernetes credentials in {where}: {e}; run the proxy "
                                 "in a pod with a ServiceAccount, or name a kubeconfig with ?kubeconfig=FILE") from None
        return client.CoreV1Api(client.ApiClient(cfg))

    def _call(self, verb: str, **kw: Any) -> Any:
        """list_namespaced_pod's raw response; its failures as DiscoveryError (410 as _Gone)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError
        t = self.target
        try:
            return self._api.list_namespaced_pod(t.namespace, label_selector=t.selector, _preload_content=False, **kw)
        except ApiException as e:
            msg = _status_message(e.body)
            if e.status == 410:
                raise _Gone(msg) from None
            if e.status == 401:
                raise DiscoveryError(f"the Kubernetes API server did not accept this proxy's credentials (401: "
                                     f"{msg}): check the kubeconfig's user or the pod's ServiceAccount token") from None
            if e.status == 403:
                raise DiscoveryError(f"the Kubernetes API server refused to {verb} pods in namespace {t.namespace} "
                                     f"(403: {msg}): grant this proxy's ServiceAccount (or kubeconfig user) get, list "
                                     f"and watch on pods in {t.namespace} with a Role and RoleBinding "
                                     "(deploy/kubernetes/base/rbac.yaml)") from None
            raise DiscoveryError(f"the Kubernetes API server answered {e.status} {e.reason} to {verb} pods in "
                                 f"{t.namespace}: {msg}") from None
        except (HTTPError, OSError) as e:
            raise DiscoveryError(f"the Kubernetes API server cannot be reached to {verb} pods: {e}") from None

    # ---- the view ----

    def _note(self, name: str, reason: str, detail: str) -> None:
        self.on_reject(reason)
        if (name, reason) in self._logged or len(self._logged) >= MAX_LOGGED:
            return
        self._logged.add((name, reason))
        logger.warning("discovery: not using pod %s/%s: %s", self.target.namespace, name, detail)

    def _set(self, pod: Pod) -> bool:
        """Track a pod's new state; whether the view changed."""
        name = pod.metadata.name
        old = self.pods.get(name)
        if old is None and len(self.pods) >= MAX_PODS:
            self.on_reject("too_many")
            if not self._full:
                self._full = True
                logger.warning("discovery: more than %d pods match %s in %s: ignoring the others until some go; "
                               "narrow ?selector=", MAX_PODS, self.target.selector, self.target.namespace)
            return False
        try:
            now = standing(pod)
        except NotInstance as e:
            self._note(name, e.reason, str(e))
            now = Standing()
        else:
            if now.record is not None:
                self._logged = {k for k in self._logged if k[0] != name}
        if now.record is None and role_of(pod) is None:
            self.pods.pop(name, None)  # selected but no instance: nothing to keep
        else:
            self.pods[name] = now
        return old != now

    def _drop(self, name: str) -> bool:
        self._logged = {k for k in self._logged if k[0] != name} if self._logged else self._logged
        if len(self.pods) < MAX_PODS:
            self._full = False
        return self.pods.pop(name, None) is not None

    def _publish(self) -> None:
        snap = Snapshot()
        for st in self.pods.values():
            if st.record is not None:
                snap.records[st.record.instance_id] = st.record
                if st.drained:
                    snap.drained.add(st.record.instance_id)
        if self._last is not None and snap == self._last:
            return
        self._last = snap
        with self._lock:
            first = self._pending is None
            self._pending = snap
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(self._hand_on)

    def _hand_on(self) -> None:
        with self._lock:
            snap, self._pending = self._pending, None
        if snap is not None:
            self.on_change(snap)

    # ---- list and watch (the watcher's thread) ----

    def _read(self, resp: Any, limit: int) -> bytes:
        out = bytearray()
        try:
            for chunk in resp.stream(1 << 16):
                out += chunk
                if len(out) > limit:
                    raise DiscoveryError(f"a pod list page from the Kubernetes API server is over {limit} bytes")
        finally:
            resp.release_conn()
        return bytes(out)

    def list_all(self) -> None:
        """One full list, a page at a time (one consistent snapshot); the view becomes it."""
        for _ in range(3):
            seen: dict[str, Pod] = {}
            cont = None
            try:
                while True:
                    kw: dict[str, Any] = {"limit": PAGE, "_request_timeout": (CONNECT_S, 60.0)}
                    if cont:
                        kw["_continue"] = cont
                    raw = self._read(self._call("list", **kw), MAX_PAGE_BYTES)
                    try:
                        page = POD_LIST.decode(raw)
                    except (msgspec.DecodeError, msgspec.ValidationError) as e:
                        raise DiscoveryError(f"the Kubernetes API server sent a pod list kvferry cannot read: "
                                             f"{e}") from None
                    for pod in page.items or ():
                        seen[pod.metadata.name] = pod
                    cont = page.metadata.continue_
                    if not cont:
                        break
            except _Gone:  # the continue token expired mid-list: start over
                continue
            for name in [n for n in self.pods if n not in seen]:
                self._drop(name)
            for pod in seen.values():
                self._set(pod)
            self.resource_version = page.metadata.resourceVersion
            self.lists += 1
            self._publish()
            return
        raise DiscoveryError("the pod list's continue token expired three times in a row: the API server is "
                             "compacting faster than one list takes")

    def _event(self, line: bytes) -> bool:
        """Apply one watch event; whether the view changed. _Gone on 410."""
        try:
            ev = EVENT.decode(line)
            if ev.type == "BOOKMARK":
                self.resource_version = BOOKMARK.decode(ev.object).metadata.resourceVersion or self.resource_version
                return False
            if ev.type == "ERROR":
                st = STATUS.decode(ev.object)
                if st.code == 410:
                    raise _Gone(st.message)
                raise DiscoveryError(f"the Kubernetes API server ended the pod watch: {st.code} {st.reason} "
                                     f"{st.message[:300]}")
            pod = POD.decode(ev.object)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise DiscoveryError(f"the Kubernetes API server sent a watch event kvferry cannot read: {e}") from None
        if pod.metadata.resourceVersion:
            self.resource_version = pod.metadata.resourceVersion
        if ev.type == "DELETED":
            return self._drop(pod.metadata.name)
        if ev.type in ("ADDED", "MODIFIED"):
            return self._set(pod)
        return False

    def watch_until(self, deadline: float) -> None:
        """Watch from the view's resourceVersion until `deadline` (monotonic), or until the watch
        ends, breaks, goes quiet or is Gone: then the caller lists again."""
        from urllib3.exceptions import HTTPError
        span = max(1, int(deadline - time.monotonic()))
        resp = self._call("watch", watch=True, resource_version=self.resource_version, allow_watch_bookmarks=True,
                          timeout_seconds=span, _request_timeout=(CONNECT_S, span + self.quiet_s))
        self._resp = resp
        buf = b""
        try:
            if self._stop.is_set():
                return
            for chunk in resp.stream(1 << 16):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > MAX_EVENT_BYTES:
                    raise DiscoveryError(f"a pod watch event over {MAX_EVENT_BYTES} bytes")
                changed = False
                for line in lines:
                    if line.strip():
                        changed |= self._event(line)
                if changed:
                    self._publish()
                if self._stop.is_set() or time.monotonic() >= deadline:
                    return
        except _Gone:
            logger.info("discovery: the pod watch's resourceVersion is gone (410): listing again")
        except (HTTPError, OSError) as e:
            if not self._stop.is_set():
                logger.info("discovery: the pod watch broke or went quiet (%s): listing again", e)
        finally:
            self._resp = None
            resp.release_conn()

    def serve(self, healthy: Callable[[], None] | None) -> None:
        """The watcher's thread: list, watch until the resync is due, list again; raises
        DiscoveryError when the API server fails."""
        if self._api is None:
            self._api = self._client()
        while not self._stop.is_set():
            self.list_all()
            if healthy is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(healthy)
            self.watch_until(time.monotonic() + self.target.resync)

    # ---- the loop's side ----

    async def run(self, healthy: Callable[[], None] | None = None) -> None:
        """Until cancelled or the API server fails (DiscoveryError: the caller pauses and calls
        again; the view is kept and re-listed then)."""
        loop = self._loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._stop.clear()

        def report(exc: BaseException | None) -> None:
            if not done.done():
                done.set_exception(exc) if exc is not None else done.set_result(None)

        def body() -> None:
            try:
                self.serve(healthy)
                loop.call_soon_threadsafe(report, None)
            except BaseException as e:  # handed to the loop, raised there
                try:
                    loop.call_soon_threadsafe(report, e)
                except RuntimeError:  # the loop closed meanwhile
                    pass
        threading.Thread(target=body, name="kvferry-k8s-discovery", daemon=True).start()
        try:
            await done
        finally:
            self._halt()

    def _halt(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:
            resp.shutdown()  # a read blocked in the watcher's thread returns now

    async def close(self) -> None:
        self._halt()
