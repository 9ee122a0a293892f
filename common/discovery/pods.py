"""What makes a Kubernetes pod a kvferry instance (``--discovery k8s://NAMESPACE``), read from the
API server's JSON with types and bounds (the API server is trusted: its RBAC decides who may
create pods; what they say is still checked before use).

A pod the selector picks is an instance when it has a role label and says what it serves:

- role: label ``kvferry.io/role`` (else ``llm-d.ai/role``): ``prefill``/``prefiller`` or
  ``decode``/``decoder``; any other value, or none, and the pod is not an instance (not logged);
- ``kvferry.io/model`` (annotation, else label): the served model name, required;
- the OpenAI port: annotation ``kvferry.io/port``, else the container port named ``http``, else 8000;
- a decoder's receiver ports, one per TP rank: annotations ``kvferry.io/init-ports`` and
  ``kvferry.io/alloc-ports`` (comma-separated), else container ports named ``kvf-init-0``,
  ``kvf-init-1``, ... and ``kvf-alloc-0``, ...; prefillers dial the pod IP;
- optional: ``kvferry.io/fingerprint`` (the KV layout fingerprint), ``kvferry.io/kv-events``
  (vLLM's event publisher[,replay] endpoints), ``kvferry.io/drain: "true"``.

Where it stands in rotation: a pod with an IP that is Running is an instance; it is drained (no
new requests, those in flight finish) while its Ready condition is not True, while it terminates
(``deletionTimestamp``) and while annotated ``kvferry.io/drain: "true"``; a pod deleted (or force
deleted), relabelled out of the selector, or no longer Running is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvferry.common.errors import BadDataError
from kvferry.common.wire import messages as m

ROLE_LABELS = ("kvferry.io/role", "llm-d.ai/role")
ROLES = {"prefill": "prefiller", "prefiller": "prefiller", "decode": "decoder", "decoder": "decoder"}
MODEL = "kvferry.io/model"
PORT = "kvferry.io/port"
INIT_PORTS, ALLOC_PORTS = "kvferry.io/init-ports", "kvferry.io/alloc-ports"
FINGERPRINT, KV_EVENTS, DRAIN = "kvferry.io/fingerprint", "kvferry.io/kv-events", "kvferry.io/drain"
DEFAULT_PORT = 8000
MAX_TP = 64


class PodMeta(msgspec.Struct):
    name: str
    resourceVersion: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    deletionTimestamp: str | None = None


class ContainerPort(msgspec.Struct):
    containerPort: int
    name: str = ""


class Container(msgspec.Struct):
    ports: list[ContainerPort] = []


class PodSpec(msgspec.Struct):
    containers: list[Container] = []


class Condition(msgspec.Struct):
    type: str
    status: str


class PodStatus(msgspec.Struct):
    phase: str = ""
    podIP: str = ""
    conditions: list[Condition] = []


class Pod(msgspec.Struct):
    metadata: PodMeta
    spec: PodSpec = msgspec.field(default_factory=PodSpec)
    status: PodStatus = msgspec.field(default_factory=PodStatus)


class ListMeta(msgspec.Struct):
    resourceVersion: str = ""
    continue_: str = msgspec.field(default="", name="continue")


class PodList(msgspec.Struct):
    metadata: ListMeta
    items: list[Pod] | None = None  # the API server writes null for none


class StatusDetails(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


class WatchEvent(msgspec.Struct):
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK | ERROR
    object: msgspec.Raw


class BookmarkMeta(msgspec.Struct):
    resourceVersion: str = ""


class Bookmark(msgspec.Struct):
    metadata: BookmarkMeta


POD = msgspec.json.Decoder(Pod)
POD_LIST = msgspec.json.Decoder(PodList)
EVENT = msgspec.json.Decoder(WatchEvent)
BOOKMARK = msgspec.json.Decoder(Bookmark)
STATUS = msgspec.json.Decoder(StatusDetails)


class NotInstance(BadDataError, ValueError):
    """A selected pod with a role that cannot be used; `reason` labels the rejection metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class Standing:
    """What one pod says: its record, and whether it is drained (None: not an instance now)."""

    record: m.InstanceRecord | None = None
    drained: bool = False


def role_of(pod: Pod) -> str | None:
    for label in ROLE_LABELS:
        value = pod.metadata.labels.get(label)
        if value is not None:
            return ROLES.get(value.lower())
    return None


def _port(raw: str, what: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise NotInstance("malformed", f"{what} {raw[:40]!r} is not a port (1-65535)")
    return port


def _ports(pod: Pod, annotation: str, prefix: str) -> list[int]:
    raw = pod.metadata.annotations.get(annotation)
    if raw is not None:
        items = [p.strip() for p in raw.split(",")]
        if not items or len(items) > MAX_TP:
            raise NotInstance("malformed", f"annotation {annotation}: 1 to {MAX_TP} ports, comma-separated")
        return [_port(p, f"annotation {annotation}:") for p in items]
    named = {p.name: p.containerPort for c in pod.spec.containers for p in c.ports if p.name.startswith(prefix)}
    out: list[int] = []
    while f"{prefix}{len(out)}" in named and len(out) < MAX_TP:
        out.append(_port(str(named[f"{prefix}{len(out)}"]), f"container port {prefix}{len(out)}"))
    return out


def _openai_port(pod: Pod) -> int:
    raw = pod.metadata.annotations.get(PORT)
    if raw is not None:
        return _port(raw, f"annotation {PORT}")
    for c in pod.spec.containers:
        for p in c.ports:
            if p.name == "http":
                return _port(str(p.containerPort), "container port http")
    return DEFAULT_PORT


def _ready(pod: Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions)


def standing(pod: Pod) -> Standing:
    """The pod's record and drain state; NotInstance when it has a role but cannot be used."""
    role = role_of(pod)
    st = pod.status
    if role is None or st.phase != "Running" or not st.podIP:
        return Standing()
    meta = pod.metadata
    model = meta.annotations.get(MODEL) or meta.labels.get(MODEL)
    if not model:
        raise NotInstance("malformed", f"no model: annotate the pod {MODEL}: SERVED_MODEL_NAME")
    host = f"[{st.podIP}]" if ":" in st.podIP else st.podIP
    extra: dict = {}
    if role == "decoder":
        init, alloc = _ports(pod, INIT_PORTS, "kvf-init-"), _ports(pod, ALLOC_PORTS, "kvf-alloc-")
        if not init or len(init) != len(alloc):
            raise NotInstance("malformed", f"a decoder needs its receiver's ports, one init and one alloc port per "
                                           f"TP rank: annotate {INIT_PORTS} and {ALLOC_PORTS} (comma-separated), or "
                                           "name its container ports kvf-init-0, kvf-alloc-0, ...")
        extra = {"init_ports": init, "alloc_ports": alloc, "receiver_host": st.podIP, "tp_size": len(init)}
    events = meta.annotations.get(KV_EVENTS)
    if events:
        extra["kv_events"] = [e.strip() for e in events.split(",")][:2]
    try:
        rec = msgspec.convert({"t": "instance", "instance_id": meta.name, "role": role, "model": model,
                               "url": f"http://{host}:{_openai_port(pod)}",
                               "fingerprint": meta.annotations.get(FINGERPRINT, ""), **extra}, m.InstanceRecord)
    except msgspec.ValidationError as e:
        raise NotInstance("malformed", str(e)) from None
    drained = (not _ready(pod) or meta.deletionTimestamp is not None
               or meta.annotations.get(DRAIN, "").lower() == "true")
    return Standing(rec, drained)
