"""deploy/kubernetes/ (kustomize) cannot rot: with no API server here, every overlay is rendered by
`kubectl kustomize`, every object is checked against the Kubernetes API's schemas (kubernetes_validate,
strict), and the properties a cluster depends on are asserted on what `kubectl apply -k` would send:
the proxy's RBAC, the discovery contract between the proxy and the instance pods (selector, role
label, annotations, ports), the decoder's config as kvferry's own loader reads it, NetworkPolicies,
probes and the cluster secret. What this does not prove: docs/testing.md "Kubernetes manifests"."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import parse_qsl, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOC = ROOT / "docs" / "kubernetes.md"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KUBECTL = shutil.which("kubectl")
# The API versions the objects are checked against: an old release still in wide use, and a newer one.
K8S_VERSIONS = ("1.30.0", "1.33.0")
NAMESPACE = "kvferry"
ROLE_LABELS = ("kvferry.io/role", "llm-d.ai/role")
ROLES = {"prefill": "prefill", "prefiller": "prefill", "decode": "decode", "decoder": "decode"}
DISCOVERY_QUERY_KEYS = {"selector", "kubeconfig", "context", "resync"}
POD_IP = "10.244.1.7"  # what status.podIP stands for when an env value is resolved here

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: these tests render deploy/kubernetes/ with `kubectl "
    "kustomize` (kubectl >= 1.27 has kustomize v5 built in); install kubectl to run them")


def kustomize(path: str) -> tuple[dict, ...]:
    """`kubectl kustomize PATH`: the objects `kubectl apply -k PATH` would send."""
    assert KUBECTL is not None
    r = subprocess.run([KUBECTL, "kustomize", path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"kubectl kustomize {path} failed: {r.stderr.strip()}"
    return tuple(o for o in yaml.safe_load_all(r.stdout) if o)


render = functools.cache(kustomize)  # each overlay once per session (~0.3 s each)


def overlay(name: str) -> tuple[dict, ...]:
    return render(str(K8S / "overlays" / name))


def of_kind(objs: tuple[dict, ...], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: tuple[dict, ...], kind: str, name: str) -> dict:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def role_of(labels: dict[str, str]) -> str | None:
    for key in ROLE_LABELS:
        if key in labels:
            return ROLES.get(labels[key])
    return None


def instances(objs: tuple[dict, ...]) -> dict[str, dict]:
    """The Deployments whose pods are kvferry instances, by role ('prefill', 'decode')."""
    found: dict[str, dict] = {}
    for d in of_kind(objs, "Deployment"):
        role = role_of(d["spec"]["template"]["metadata"].get("labels", {}))
        if role is not None:
            assert role not in found, f"two {role} Deployments: {found[role]['metadata']['name']}, " \
                                      f"{d['metadata']['name']}"
            found[role] = d
    assert set(found) == {"prefill", "decode"}, f"instance Deployments by role: {sorted(found)}"
    return found


def proxy(objs: tuple[dict, ...]) -> dict:
    return named(objs, "Deployment", "kvferry-proxy")


def container(deploy: dict) -> dict:
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{deploy['metadata']['name']}: expected one container"
    return containers[0]


def env_of(objs: tuple[dict, ...], deploy: dict) -> dict[str, str]:
    """The container's environment as the kubelet resolves it (secrets as placeholders)."""
    env: dict[str, str] = {}
    for e in container(deploy).get("env", []):
        src = e.get("valueFrom")
        if src is None:
            env[e["name"]] = expand(e.get("value", ""), env)
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            env[e["name"]] = named(objs, "ConfigMap", ref["name"])["data"][ref["key"]]
        elif "fieldRef" in src:
            field = src["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.namespace": deploy["metadata"]["namespace"], "status.podIP": POD_IP,
                              "metadata.name": deploy["metadata"]["name"] + "-abc12"}[field]
        elif "secretKeyRef" in src:
            env[e["name"]] = f"<secret {src['secretKeyRef']['name']}/{src['secretKeyRef']['key']}>"
        else:
            raise AssertionError(f"{deploy['metadata']['name']}: env {e['name']} has an unexpected source {src}")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command, args and env values ($$ is a literal $)."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        assert m.group(1) in env, f"$({m.group(1)}) is not in the container's env: Kubernetes would pass it as is"
        return env[m.group(1)]
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def argv(objs: tuple[dict, ...], deploy: dict) -> list[str]:
    c, env = container(deploy), env_of(objs, deploy)
    return [expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]


def flag(args: list[str], name: str) -> str:
    """The value of --name=VALUE or --name VALUE (exactly once)."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    values += [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    assert len(values) == 1, f"{name} is given {len(values)} times in {args}"
    return values[0]


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """A label selector as the API server's ?labelSelector= reads it (equality and existence terms)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        m = re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", term)
        if m:
            key, op, value = m.groups()
            if (labels.get(key) == value) != (op != "!="):
                return False
        elif re.fullmatch(r"!?[\w./-]+", term):
            if (term.lstrip("!") in labels) == term.startswith("!"):
                return False
        else:
            raise AssertionError(f"label selector term {term!r}: this test reads equality and existence terms only")
    return True


def label_selector_matches(sel: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector object (matchLabels, matchExpressions): an empty one matches every pod."""
    if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def discovery(objs: tuple[dict, ...]) -> tuple[str, str, dict[str, str]]:
    """The proxy's --discovery k8s://NAMESPACE?selector=... as the proxy reads it: namespace,
    decoded selector, and the whole query."""
    value = flag(argv(objs, proxy(objs)), "--discovery")
    parts = urlsplit(value)
    assert parts.scheme == "k8s", f"--discovery {value!r}: expected k8s://NAMESPACE?selector=..."
    query = dict(parse_qsl(parts.query, strict_parsing=bool(parts.query)))
    unknown = set(query) - DISCOVERY_QUERY_KEYS
    assert not unknown, f"--discovery {value!r}: unknown query keys {unknown}"
    return parts.netloc, query.get("selector", "app.kubernetes.io/part-of=kvferry"), query


def images(objs: tuple[dict, ...]) -> set[str]:
    return {c["image"] for d in of_kind(objs, "Deployment") for c in d["spec"]["template"]["spec"]["containers"]}


def pod_labels(deploy: dict) -> dict[str, str]:
    return deploy["spec"]["template"]["metadata"].get("labels", {})


def kvferry_pods(objs: tuple[dict, ...]) -> list[dict]:
    return [d for d in of_kind(objs, "Deployment") if pod_labels(d).get("app.kubernetes.io/part-of") == "kvferry"]


def port_named(deploy: dict, name: str) -> int | None:
    ports = [p["containerPort"] for p in container(deploy).get("ports", []) if p.get("name") == name]
    return ports[0] if ports else None


def mount_path(deploy: dict, volume: dict) -> str:
    mounts = [m["mountPath"] for m in container(deploy).get("volumeMounts", []) if m["name"] == volume["name"]]
    assert len(mounts) == 1, f"{deploy['metadata']['name']}: volume {volume['name']} is mounted {len(mounts)} times"
    return mounts[0]


def volume(deploy: dict, key: str, name: str) -> dict:
    vols = [v for v in deploy["spec"]["template"]["spec"].get("volumes", [])
            if key in v and v[key].get("secretName" if key == "secret" else "name") == name]
    assert len(vols) == 1, f"{deploy['metadata']['name']}: expected one {key} volume of {name}"
    return vols[0]


def config_file(objs: tuple[dict, ...], deploy: dict) -> str:
    """The text of the file KVFERRY_CONFIG_FILE names, through the pod's ConfigMap volume."""
    path = env_of(objs, deploy)["KVFERRY_CONFIG_FILE"]
    for v in deploy["spec"]["template"]["spec"]["volumes"]:
        if "configMap" in v:
            folder = mount_path(deploy, v)
            if path.startswith(folder + "/"):
                return named(objs, "ConfigMap", v["configMap"]["name"])["data"][path[len(folder) + 1:]]
    raise AssertionError(f"{deploy['metadata']['name']}: KVFERRY_CONFIG_FILE {path} is in no mounted ConfigMap")


def connector_config(objs: tuple[dict, ...], deploy: dict, tmp_path: Path) -> Any:
    """The instance's kvferry config as the connector loads it: its config file and its whole
    environment (an unknown KVFERRY_* variable fails here as it would in the pod). The cluster secret
    is a file of the test's, the mounted path being checked elsewhere."""
    from kvferry.common import secret
    from kvferry.common.config import load_config
    cfg = tmp_path / "kvferry.yaml"
    cfg.write_text(config_file(objs, deploy))
    key = tmp_path / "cluster.secret"
    if not key.exists():
        secret.write_file(str(key), secret.generate())
    env = {**env_of(objs, deploy), "KVFERRY_CONFIG_FILE": str(cfg), "KVFERRY_CLUSTER_SECRET_FILE": str(key)}
    return load_config(env=env)


def kv_transfer_config(args: list[str]) -> dict:
    return json.loads(flag(args, "--kv-transfer-config"))


def ints(csv: str) -> list[int]:
    return [int(p) for p in csv.split(",")]


# --- the objects themselves ---------------------------------------------------------------------

def check_servicemonitor(objs: tuple[dict, ...], sm: dict) -> None:
    """What the Prometheus Operator needs of a ServiceMonitor (kubernetes_validate knows no CRDs): a
    selector that picks the proxy's and the engines' Services, and endpoints on ports they name."""
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    assert set(sm["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    picked = [s for s in of_kind(objs, "Service")
              if label_selector_matches(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in picked} == {"kvferry-proxy", "kvferry-engines"}
    assert sm["spec"]["endpoints"], "a ServiceMonitor without endpoints scrapes nothing"
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
        assert ep["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", ep["interval"])
        for s in picked:
            ports = {p["name"] for p in s["spec"]["ports"]}
            assert ep["port"] in ports, f"{s['metadata']['name']} has no port {ep['port']}"


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_kubernetes_overlay_renders_into_valid_objects(name: str) -> None:
    import kubernetes_validate
    objs = overlay(name)
    assert objs, f"overlay {name} renders nothing"
    for o in objs:
        what = f"{name}: {o['kind']} {o['metadata']['name']}"
        assert o["metadata"].get("namespace") == NAMESPACE, f"{what}: namespace {o['metadata'].get('namespace')}"
        labels = o["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "kvferry", f"{what}: no part-of label"
        if o["kind"] == "ServiceMonitor":
            check_servicemonitor(objs, o)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(f"{what} is not a valid object for Kubernetes {version}: {e.message} "
                                     f"at {'.'.join(map(str, e.path))}") from None
    for d in of_kind(objs, "Deployment"):
        assert label_selector_matches(d["spec"]["selector"], pod_labels(d)), f"{d['metadata']['name']}: selector"
        assert {c["image"].split(":")[0] for c in d["spec"]["template"]["spec"]["containers"]} == {"kvferry-vllm"}


def test_kubernetes_overlays_are_the_documented_ones() -> None:
    assert {"1p1d", "xpyd-tp", "monitoring"} <= set(OVERLAYS)
    assert [o["kind"] for o in overlay("monitoring") if o["kind"] == "ServiceMonitor"] == ["ServiceMonitor"]
    assert not of_kind(overlay("1p1d"), "ServiceMonitor"), "1p1d must apply without the Prometheus Operator's CRDs"


@pytest.mark.parametrize("name", OVERLAYS)
def test_k8s_proxy_role_grants_only_reading_pods(name: str) -> None:
    objs = overlay(name)
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")
    (role,) = of_kind(objs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (binding,) = of_kind(objs, "RoleBinding")
    ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["roleRef"] == ref
    sa = proxy(objs)["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    named(objs, "ServiceAccount", sa)
    for d in instances(objs).values():  # vLLM gets no token at all
        assert d["spec"]["template"]["spec"].get("automountServiceAccountToken") is False


@pytest.mark.parametrize("name", OVERLAYS)
def test_k8s_instance_pods_match_the_proxy_discovery(name: str) -> None:
    objs = overlay(name)
    namespace, selector, _ = discovery(objs)
    p_args = argv(objs, proxy(objs))
    model = flag(p_args, "--discovery-model")
    assert model and "$(" not in model
    assert not selector_matches(selector, {}), f"selector {selector!r} matches every pod of the namespace"
    assert role_of(pod_labels(proxy(objs))) is None, "the proxy's pods must not look like instances"
    for role, d in instances(objs).items():
        what = f"{name}: {d['metadata']['name']}"
        assert d["metadata"]["namespace"] == namespace, f"{what} is outside the namespace the proxy watches"
        assert selector_matches(selector, pod_labels(d)), f"{what}: pod labels {pod_labels(d)} miss {selector!r}"
        notes = d["spec"]["template"]["metadata"]["annotations"]
        args = argv(objs, d)
        assert notes["kvferry.io/model"] == model == flag(args, "--served-model-name"), what
        assert int(notes["kvferry.io/port"]) == port_named(d, "http") == int(flag(args, "--port")), what
        assert flag(args, "--host") in ("0.0.0.0", "::"), f"{what}: vLLM must listen on the pod IP"
        ktc = kv_transfer_config(args)
        assert (ktc["kv_connector"], ktc["kv_connector_module_path"]) == ("KVFerryConnector", "kvferry.connector")
        assert ktc["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role], what
        if role == "prefill":
            assert not {"kvferry.io/init-ports", "kvferry.io/alloc-ports"} & set(notes), what


def test_k8s_discovery_value_is_one_the_proxy_accepts() -> None:
    """The proxy's own flag parser takes every flag of the Deployment. k8s:// itself is checked by
    kvferry's discovery parser where this tree has it."""
    from kvferry.common.discovery.sources import DiscoveryError, parse_target
    from kvferry.proxy import options
    args = argv(overlay("1p1d"), proxy(overlay("1p1d")))
    assert args[0] == "kvferry-proxy"
    admin_key = {"KVFERRY_ADMIN_KEY": "k" * 32}
    with mock.patch("kvferry.common.discovery.sources.parse_target"), mock.patch.dict("os.environ", admin_key):
        o = options.parse(args[1:])
    assert (o.host, o.port, o.workers, o.require_cluster_secret) == ("0.0.0.0", 9000, 1, True)
    assert o.discovery_model == "Qwen/Qwen2.5-0.5B-Instruct"
    try:
        parse_target(o.discovery)
    except DiscoveryError as e:
        if "k8s" not in str(e).split(":")[0] and "expected etcd://" in str(e):
            pytest.skip(f"this tree's discovery has no k8s:// yet ({e})")
        raise


@pytest.mark.parametrize("name", OVERLAYS)
def test_k8s_decoder_ports_agree_with_its_config_and_tp_size(name: str, tmp_path: Path) -> None:
    objs = overlay(name)
    for role, d in instances(objs).items():
        args = argv(objs, d)
        tp = int(flag(args, "--tensor-parallel-size"))
        res = container(d)["resources"]
        gpus = (int(res["limits"]["nvidia.com/gpu"]), int(res["requests"]["nvidia.com/gpu"]))
        assert gpus == (tp, tp), f"{d['metadata']['name']}: GPUs {gpus} at TP {tp}"
        cfg = connector_config(objs, d, tmp_path)
        assert cfg.enable_pd and cfg.pd_role == {"prefill": "sender", "decode": "receiver"}[role]
        assert cfg.pd_buffer_device == "cuda" and cfg.require_cluster_secret
        if role != "decode":
            continue
        notes = d["spec"]["template"]["metadata"]["annotations"]
        init, alloc = ints(notes["kvferry.io/init-ports"]), ints(notes["kvferry.io/alloc-ports"])
        assert len(init) == len(alloc) == tp, f"{name}: TP {tp} needs {tp} init and alloc ports: {init}, {alloc}"
        assert init == [port_named(d, f"kvf-init-{r}") for r in range(tp)]
        assert alloc == [port_named(d, f"kvf-alloc-{r}") for r in range(tp)]
        assert port_named(d, f"kvf-init-{tp}") is None and port_named(d, f"kvf-alloc-{tp}") is None
        assert (cfg.ports("pd_peer_init_port"), cfg.ports("pd_peer_alloc_port")) == (init, alloc)
        assert len(set(init + alloc + [port_named(d, "http")])) == 2 * tp + 1, "ports must differ"
        # the receiver binds every interface and tells prefillers the pod's IP
        assert cfg.pd_peer_host == "0.0.0.0" and cfg.pd_peer_advertise_host == POD_IP


def test_k8s_tp_overlay_runs_tensor_parallel_with_a_receiver_per_rank(tmp_path: Path) -> None:
    objs = overlay("xpyd-tp")
    found = instances(objs)
    for d in found.values():
        assert d["spec"]["replicas"] == 2 and int(flag(argv(objs, d), "--tensor-parallel-size")) == 2
    cfg = connector_config(objs, found["decode"], tmp_path)
    assert len(cfg.ports("pd_peer_init_port")) == len(cfg.ports("pd_peer_alloc_port")) == 2
    for d in instances(overlay("1p1d")).values():
        assert d["spec"]["replicas"] == 1 and int(flag(argv(overlay("1p1d"), d), "--tensor-parallel-size")) == 1


@pytest.mark.parametrize("name", OVERLAYS)
def test_k8s_network_policy_admits_only_kvferry_pods_to_instances(name: str) -> None:
    objs = overlay(name)
    policies = of_kind(objs, "NetworkPolicy")
    kvferry = [pod_labels(d) for d in kvferry_pods(objs)]
    for d in instances(objs).values():
        mine = [p for p in policies if label_selector_matches(p["spec"]["podSelector"], pod_labels(d))]
        assert mine, f"{name}: no NetworkPolicy selects {d['metadata']['name']}: every pod may reach its KV ports"
        from_kvferry = False
        for p in mine:
            assert "Ingress" in p["spec"]["policyTypes"]
            for rule in p["spec"].get("ingress", []):
                peers = rule.get("from")
                assert peers, f"{name}: {p['metadata']['name']} admits every source"
                for peer in peers:
                    assert "ipBlock" not in peer, f"{name}: {p['metadata']['name']} admits an address block"
                    if "namespaceSelector" in peer:  # Prometheus: vLLM's HTTP port (/metrics) only
                        assert "podSelector" not in peer and p["metadata"]["name"] == "kvferry-prometheus"
                        assert [q["port"] for q in rule["ports"]] == [port_named(d, "http")]
                        continue
                    sel = peer["podSelector"]
                    assert not label_selector_matches(sel, {"app": "stranger"}), f"{name}: admits any pod"
                    assert sel.get("matchLabels", {}).get("app.kubernetes.io/part-of") == "kvferry"
                    assert all(label_selector_matches(sel, labels) for labels in kvferry), "a kvferry pod is left out"
                    from_kvferry = True
        assert from_kvferry, f"{name}: {d['metadata']['name']} admits no kvferry pod (the proxy cannot reach it)"
    (mine,) = [p for p in policies if label_selector_matches(p["spec"]["podSelector"], pod_labels(proxy(objs)))]
    assert mine["spec"]["ingress"] == [{"ports": [{"port": 9000, "protocol": "TCP"}]}]


@pytest.mark.parametrize("name", OVERLAYS)
def test_k8s_probes_point_at_health(name: str) -> None:
    objs = overlay(name)
    for d in [proxy(objs), *instances(objs).values()]:
        c = container(d)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe not in c:
                continue
            get = c[probe]["httpGet"]
            assert get["port"] == "http" and port_named(d, "http"), f"{d['metadata']['name']} {probe}"
            # the proxy's liveness is /metrics: its /health is 503 until a decoder is ready, and a
            # proxy waiting for vLLM to load a model must not be restarted for it
            want = "/metrics" if (d is proxy(objs) and probe == "livenessProbe") else "/health"
            assert get["path"] == want, f"{d['metadata']['name']} {probe}: {get['path']}"
        assert "readinessProbe" in c and "livenessProbe" in c
    for d in instances(objs).values():
        assert container(d)["startupProbe"]["failureThreshold"] * container(d)["startupProbe"]["periodSeconds"] >= 600
    p = proxy(objs)
    assert port_named(p, "http") == 9000 and p["spec"]["replicas"] == 2
    (pdb,) = of_kind(objs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 and label_selector_matches(pdb["spec"]["selector"], pod_labels(p))
    svc = named(objs, "Service", "kvferry-proxy")
    assert label_selector_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(p))
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http"}]


@pytest.mark.parametrize("name", OVERLAYS)
def test_k8s_cluster_secret_is_a_0400_file_everywhere(name: str) -> None:
    objs = overlay(name)
    p = proxy(objs)
    vol = volume(p, "secret", "kvferry-cluster-secret")
    assert vol["secret"]["defaultMode"] == 0o400
    (item,) = vol["secret"]["items"]
    args = argv(objs, p)
    assert flag(args, "--cluster-secret-file") == f"{mount_path(p, vol)}/{item['path']}"
    assert "--require-cluster-secret" in args
    assert env_of(objs, p)["KVFERRY_ADMIN_KEY"] == "<secret kvferry-admin-key/admin-key>"
    for d in instances(objs).values():
        vol = volume(d, "secret", "kvferry-cluster-secret")
        assert vol["secret"]["defaultMode"] == 0o400 and vol["secret"]["items"] == [item]
        cfg = yaml.safe_load(config_file(objs, d))
        assert cfg["cluster_secret_file"] == f"{mount_path(d, vol)}/{item['path']}"
        assert cfg["require_cluster_secret"] is True
        # Service links would put KVFERRY_PROXY_PORT and friends in vLLM's env: unknown config keys
        assert d["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_k8s_one_overlay_of_yours_changes_the_model_and_image_everywhere(tmp_path: Path) -> None:
    """docs/kubernetes.md's own overlay: the image and the model are set in one place each."""
    mine = tmp_path / "my-cluster"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE,
        "resources": [os.path.relpath(K8S / "overlays" / "xpyd-tp", mine)],  # kustomize takes no absolute path
        "images": [{"name": "kvferry-vllm", "newName": "registry.example.com/kvferry-vllm", "newTag": "v1"}],
        "configMapGenerator": [{"name": "kvferry-model", "behavior": "merge",
                                "literals": ["model=meta-llama/Llama-3.1-8B-Instruct", "served_model_name=llama"]}],
    }))
    stale = kustomize(str(mine))  # without components/model the annotation keeps the base's name: the
    (d, *_) = instances(stale).values()  # proxies would refuse every instance as another model
    assert d["spec"]["template"]["metadata"]["annotations"]["kvferry.io/model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    k = yaml.safe_load((mine / "kustomization.yaml").read_text())
    k["components"] = [os.path.relpath(K8S / "components" / "model", mine)]
    (mine / "kustomization.yaml").write_text(yaml.safe_dump(k))
    objs = kustomize(str(mine))
    assert images(objs) == {"registry.example.com/kvferry-vllm:v1"}
    assert flag(argv(objs, proxy(objs)), "--discovery-model") == "llama"
    for d in instances(objs).values():
        assert d["spec"]["template"]["metadata"]["annotations"]["kvferry.io/model"] == "llama"
        assert flag(argv(objs, d), "--model") == "meta-llama/Llama-3.1-8B-Instruct"


# --- the walkthrough's commands -----------------------------------------------------------------

def doc_commands() -> list[str]:
    """Every line of docs/kubernetes.md's shell blocks, continuation lines joined."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.DOTALL)
    return [line.strip() for b in blocks for line in b.replace("\\\n", " ").splitlines() if line.strip()]


def documented_overlay(path: str, tmp_path: Path) -> tuple[dict, ...]:
    """The overlay of the reader's own that docs/kubernetes.md shows (a yaml block whose first line is
    `# PATH/kustomization.yaml`, in a clone of kvferry), rendered from a copy in tmp_path."""
    text = DOC.read_text(encoding="utf-8")
    blocks = [textwrap.dedent(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)]
    blocks = [b for b in blocks if b.startswith(f"# {path.rstrip('/')}/kustomization.yaml\n")]
    assert len(blocks) == 1, f"docs/kubernetes.md applies {path} but shows no `# {path}/kustomization.yaml` block"
    k = yaml.safe_load(blocks[0])
    mine = tmp_path / path
    mine.mkdir(parents=True)
    k["resources"] = [os.path.relpath((ROOT / path / r).resolve(), mine) for r in k["resources"]]
    (mine / "kustomization.yaml").write_text(yaml.safe_dump(k))
    return render(str(mine))


def test_k8s_every_documented_kustomize_command_names_an_overlay_that_renders(tmp_path: Path) -> None:
    applied = []
    for line in doc_commands():
        words = shlex.split(line, comments=True)
        if words[:3] == ["kubectl", "apply", "-k"] or words[:2] == ["kubectl", "kustomize"]:
            path = next(w for w in words[2:] if not w.startswith("-"))
            target = (ROOT / path).resolve()
            if not target.is_relative_to(K8S):
                objs = documented_overlay(path, tmp_path)
                assert images(objs) == {"registry.example.com/kvferry-vllm:v1"}
                applied.append(path)
                continue
            assert target.parent == K8S / "overlays", f"docs/kubernetes.md: {line!r} names {path}, not an overlay"
            assert target.name in OVERLAYS, f"docs/kubernetes.md: {line!r}: no overlay {target.name}"
            assert overlay(target.name)
            applied.append(target.name)
    assert {"my-cluster", "xpyd-tp", "monitoring"} <= set(applied), f"docs/kubernetes.md applies {sorted(set(applied))}"


def without_namespace(words: list[str]) -> list[str]:
    """A kubectl command's words less -n NAME / --namespace NAME."""
    out: list[str] = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w in ("-n", "--namespace"):
            skip = True
        elif not w.startswith("--namespace="):
            out.append(w)
    return out


def test_k8s_documented_grafana_configmap_command_builds_the_dashboard() -> None:
    assert KUBECTL is not None
    found = [shlex.split(c, comments=True) for c in doc_commands() if c.startswith("kubectl ")]
    (words,) = [w for w in found if without_namespace(w)[1:3] == ["create", "configmap"]]
    files = [w.split("=", 1)[1] for w in words if w.startswith("--from-file=")]
    assert files == ["deploy/grafana/kvferry.json"] and (ROOT / files[0]).is_file()
    r = subprocess.run([KUBECTL, *words[1:], "--dry-run=client", "-o", "yaml"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cm = yaml.safe_load(r.stdout)
    import kubernetes_validate
    kubernetes_validate.validate(cm, K8S_VERSIONS[0], strict=True)
    assert json.loads(cm["data"]["kvferry.json"])["panels"]
    assert len(r.stdout) < 900_000, "a ConfigMap holds at most 1 MiB"
    name = cm["metadata"]["name"]
    label = rf"kubectl (-n \S+ )?label configmap {name} grafana_dashboard=1"
    assert any(re.fullmatch(label, c) for c in doc_commands()), "docs/kubernetes.md must label the ConfigMap"


@pytest.mark.slow
def test_k8s_vllm_flags_parse_with_vllms_own_parser() -> None:
    """Every instance's vLLM command line through vLLM's parser (slow: importing it takes ~30 s)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    for name in OVERLAYS:
        objs = overlay(name)
        for d in instances(objs).values():
            args = argv(objs, d)
            assert args[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
            ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args[3:])
            assert ns.kv_transfer_config.kv_connector == "KVFerryConnector"
            assert ns.tensor_parallel_size == int(flag(args, "--tensor-parallel-size"))
