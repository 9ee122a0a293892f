"""A Kubernetes API server for pods only, faithful to the protocol a pod watcher relies on, for
testing ``--discovery k8s://`` with the real client library where no API server can run.

What it serves, as the real API server does (``GET /api/v1/namespaces/NS/pods``):

- a list: a PodList whose ``metadata.resourceVersion`` is the store's revision, paged by ``limit``
  and ``continue`` (each page from the same snapshot; an expired token is ``410``), filtered by
  ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``, ``k notin (a,b)``);
- a watch (``watch=true``): a chunked stream of one JSON event per line (ADDED, MODIFIED, DELETED,
  BOOKMARK with ``allowWatchBookmarks``, ERROR), from ``resourceVersion`` on (older than the
  compacted revision: an ERROR event with code 410 "Expired"; none or "0": synthetic ADDED events
  for what exists first), ended after ``timeoutSeconds``; with a label selector a pod that stops
  matching comes as DELETED and one that starts matching as ADDED, as the watch cache sends them;
- bearer-token authentication (401 Status) and per-token verbs (403 Status worded as RBAC words it:
  ``pods is forbidden: User "..." cannot watch resource "pods" in API group "" in the namespace "..."``).

Test controls (any thread): add, ready, relabel, annotate, terminate (graceful: deletionTimestamp
first), delete (force: no deletionTimestamp), ``lose`` (a pod vanishes and no watcher hears of
it: a lost event), ``disconnect`` (every open watch ends), ``compact``, ``gone_next_watch``,
``silence`` (open watches send nothing more and do not end: a stale connection).

What it does not prove is listed in docs/testing.md.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import yaml

_PATH = re.compile(r"^/api/v1/namespaces/([a-z0-9-]+)/pods$")
_SET = re.compile(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$")


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Kubernetes' label selector grammar (equality- and set-based)."""
    if not selector:
        return True
    parts, depth, cur = [], 0, ""
    for ch in selector:  # split on commas outside parentheses
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for raw in (p.strip() for p in parts):
        if m := _SET.match(raw):
            values = {v.strip() for v in m.group(3).split(",")}
            ok = labels.get(m.group(1)) in values
            if (m.group(2) == "in") != ok:
                return False
        elif "!=" in raw:
            k, v = (s.strip() for s in raw.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in raw:
            k, v = (s.strip() for s in raw.replace("==", "=").split("=", 1))
            if labels.get(k) != v:
                return False
        elif raw.startswith("!"):
            if raw[1:].strip() in labels:
                return False
        elif raw not in labels:
            return False
    return True


@dataclass
class _Event:
    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict
    old: dict | None  # the object before (for selector transitions)


class PodStore:
    """The pods, their revisions and the event history, with the controls a test changes them by
    (any thread)."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict] = {}
        self.rv = 1
        self.compacted = 0  # watches from before this revision get 410
        self.history: list[_Event] = []
        self.cond = threading.Condition()
        self.epoch = 0  # bumped by disconnect(): open watches end
        self.silent = False
        self.gone_next = 0
        self.requests: list[tuple[str, dict[str, str]]] = []  # (kind: list|watch, query) of every pod request
        self._snapshots: dict[str, tuple[int, list[dict]]] = {}

    # ---- the store (test controls) ----

    def _commit(self, kind: str, key: tuple[str, str], obj: dict | None, record: bool = True) -> None:
        """Under the lock: the store's next revision."""
        self.rv += 1
        old = self.pods.get(key)
        if obj is None:
            gone = self.pods.pop(key)
            gone = copy.deepcopy(gone)
            gone["metadata"]["resourceVersion"] = str(self.rv)
            obj = gone
        else:
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.pods[key] = obj
        if record:
            self.history.append(_Event(self.rv, kind, copy.deepcopy(obj), copy.deepcopy(old) if old else None))
            if len(self.history) > 100_000:
                self.compacted = self.history[50_000].rv
                del self.history[:50_000]
        self.cond.notify_all()

    def add(self, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None,
            ip: str = "127.0.0.1", ports: dict[str, int] | None = None, ready: bool = True,
            phase: str = "Running", namespace: str = "kvferry") -> None:
        pod = {"kind": "Pod", "apiVersion": "v1",
               "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                            "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "labels": dict(labels), "annotations": dict(annotations or {})},
               "spec": {"containers": [{"name": "vllm", "image": "kvferry-vllm",
                                        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"}
                                                  for n, p in (ports or {}).items()]}]},
               "status": {"phase": phase, "podIP": ip if phase == "Running" else "",
                          "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        with self.cond:
            self._commit("ADDED", (namespace, name), pod)

    def _change(self, name: str, namespace: str, how) -> None:
        with self.cond:
            pod = copy.deepcopy(self.pods[(namespace, name)])
            how(pod)
            self._commit("MODIFIED", (namespace, name), pod)

    def ready(self, name: str, ready: bool, namespace: str = "kvferry") -> None:
        def set_ready(p: dict) -> None:
            p["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        self._change(name, namespace, set_ready)

    def relabel(self, name: str, labels: dict[str, str], namespace: str = "kvferry") -> None:
        self._change(name, namespace, lambda p: p["metadata"].update(labels=dict(labels)))

    def annotate(self, name: str, annotations: dict[str, str], namespace: str = "kvferry") -> None:
        self._change(name, namespace, lambda p: p["metadata"]["annotations"].update(annotations))

    def terminate(self, name: str, namespace: str = "kvferry") -> None:
        """A graceful delete's first step: deletionTimestamp set (and the pod not ready)."""
        def mark(p: dict) -> None:
            p["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            p["metadata"]["deletionGracePeriodSeconds"] = 30
        self._change(name, namespace, mark)

    def delete(self, name: str, namespace: str = "kvferry") -> None:
        """The pod is gone (the end of a graceful delete, or a force delete: no deletionTimestamp first)."""
        with self.cond:
            self._commit("DELETED", (namespace, name), None)

    def lose(self, name: str, namespace: str = "kvferry") -> None:
        """The pod is gone and no watch event says so (an event lost while a watch was down)."""
        with self.cond:
            self._commit("DELETED", (namespace, name), None, record=False)

    def disconnect(self) -> None:
        """Every open watch ends now."""
        with self.cond:
            self.epoch += 1
            self.cond.notify_all()

    def compact(self) -> None:
        """Watches from any revision before now get 410 Gone."""
        with self.cond:
            self.compacted = self.rv
            self.history.clear()
            self._snapshots.clear()

    def gone_next_watch(self, n: int = 1) -> None:
        with self.cond:
            self.gone_next += n

    def silence(self, on: bool = True) -> None:
        """Open watches send nothing more (no event, no bookmark) and never end, until turned off."""
        with self.cond:
            self.silent = on
            self.cond.notify_all()

    def count(self, kind: str) -> int:
        with self.cond:
            return sum(1 for k, _ in self.requests if k == kind)

    def _selected(self, ns: str, selector: str) -> list[dict]:
        return [copy.deepcopy(p) for (n, _), p in sorted(self.pods.items()) if n == ns
                and selector_matches(selector, p["metadata"].get("labels") or {})]

    def _events(self, ns: str, selector: str, since: int) -> Iterator[tuple[int, str, dict]]:
        """Under the lock: what a watcher from `since` is sent, with selector transitions."""
        for ev in self.history:
            if ev.rv <= since or ev.obj["metadata"]["namespace"] != ns:
                continue
            now = selector_matches(selector, ev.obj["metadata"].get("labels") or {})
            before = ev.old is not None and selector_matches(selector, ev.old["metadata"].get("labels") or {})
            if ev.type == "DELETED":
                if before:
                    yield ev.rv, "DELETED", ev.obj
            elif now and not before:
                yield ev.rv, "ADDED", ev.obj
            elif before and not now:
                yield ev.rv, "DELETED", ev.obj
            elif now:
                yield ev.rv, ev.type, ev.obj


class FakeKube(PodStore):
    """The API server (a thread per connection); `url` once started. Use as a context manager."""

    def __init__(self, tokens: dict[str, set[str] | None] | None = None, bookmark_s: float = 1.0,
                 user: str = "system:serviceaccount:kvferry:kvferry-proxy",
                 tls: tuple[Path, Path] | None = None) -> None:
        """`tokens`: token -> the verbs it may use on pods (None: all); `tls`: (certificate, key)
        to serve https, as an API server does (in-cluster clients insist on it)."""
        super().__init__()
        self.tls = tls
        self.tokens = tokens if tokens is not None else {"test-token": None}
        self.user, self.bookmark_s = user, bookmark_s
        self._server: ThreadingHTTPServer | None = None
        self.url = ""
        self.port = 0

    # ---- life ----

    def __enter__(self) -> FakeKube:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:
                fake._serve(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        scheme = "http"
        if self.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(self.tls[0]), str(self.tls[1]))
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, name="fake-kube", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        with self.cond:
            self.epoch += 1
            self.silent = False
            self.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig(self, path: Path, token: str = "test-token", namespace: str = "kvferry") -> Path:
        """A kubeconfig naming this server and `token`."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "proxy", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "proxy", "namespace": namespace}}]}))
        path.chmod(0o600)
        return path

    # ---- HTTP ----

    def _status(self, h: BaseHTTPRequestHandler, code: int, reason: str, message: str) -> None:
        body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": reason, "code": code}).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        u = urlsplit(h.path)
        m = _PATH.match(u.path)
        q = {k: v[-1] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        watch = q.get("watch") in ("true", "1")
        verb = "watch" if watch else "list"
        auth = h.headers.get("Authorization", "")
        token = auth[7:] if auth[:7].lower() == "bearer " else None  # the scheme is case-insensitive
        if self.tokens and token not in self.tokens:
            return self._status(h, 401, "Unauthorized", "Unauthorized")
        if m is None:
            return self._status(h, 404, "NotFound", "the server could not find the requested resource")
        ns = m.group(1)
        allowed = self.tokens.get(token) if self.tokens and token is not None else None
        if allowed is not None and verb not in allowed:
            return self._status(h, 403, "Forbidden", f'pods is forbidden: User "{self.user}" cannot {verb} resource '
                                                     f'"pods" in API group "" in the namespace "{ns}"')
        with self.cond:
            self.requests.append((verb, q))
        if watch:
            self._watch(h, ns, q)
        else:
            self._list(h, ns, q)

    def _list(self, h: BaseHTTPRequestHandler, ns: str, q: dict[str, str]) -> None:
        selector, limit = q.get("labelSelector", ""), int(q.get("limit") or 0)
        with self.cond:
            if q.get("continue"):
                token = q["continue"]
                if token not in self._snapshots:
                    return self._status(h, 410, "Expired", "The provided continue parameter is too old to display "
                                                           "a consistent list result.")
                rv, items = self._snapshots.pop(token)
            else:
                rv, items = self.rv, self._selected(ns, selector)
            cont = ""
            if limit and len(items) > limit:
                items, rest = items[:limit], items[limit:]
                cont = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode()
                self._snapshots[cont] = (rv, rest)
        meta: dict = {"resourceVersion": str(rv)}
        if cont:
            meta["continue"] = cont
        body = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _watch(self, h: BaseHTTPRequestHandler, ns: str, q: dict[str, str]) -> None:
        selector = q.get("labelSelector", "")
        timeout = float(q.get("timeoutSeconds") or 1800)
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(kind: str, obj: dict) -> None:
            line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            h.wfile.flush()

        raw_rv = q.get("resourceVersion", "")
        try:
            with self.cond:
                epoch = self.epoch
                if self.gone_next:
                    self.gone_next -= 1
                    since = -1
                elif raw_rv in ("", "0"):
                    since = self.rv
                    for p in self._selected(ns, selector):
                        send("ADDED", p)
                else:
                    since = int(raw_rv)
                if since < self.compacted or since == -1:
                    send("ERROR", {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                   "message": f"too old resource version: {raw_rv} ({self.compacted})",
                                   "reason": "Expired", "code": 410})
                    h.wfile.write(b"0\r\n\r\n")
                    return
                end = time.monotonic() + timeout
                next_mark = time.monotonic() + self.bookmark_s
                while True:
                    if self.epoch != epoch:
                        return  # cut: no terminating chunk, as a dropped connection
                    if self.silent:
                        self.cond.wait(1.0)
                        continue
                    for rv, kind, obj in list(self._events(ns, selector, since)):
                        send(kind, obj)
                        since = rv
                    now = time.monotonic()
                    if now >= end:
                        break
                    if bookmarks and now >= next_mark:
                        send("BOOKMARK", {"kind": "Pod", "apiVersion": "v1",
                                          "metadata": {"resourceVersion": str(max(since, self.rv))}})
                        since = max(since, self.rv)
                        next_mark = now + self.bookmark_s
                    self.cond.wait(min(end, next_mark if bookmarks else end) - now)
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            h.close_connection = True
