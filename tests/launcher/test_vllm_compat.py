"""The vLLM kvferry supports: the version range (the `cuda` extra, the connector's start-up check
and its override) and the API check of the connector against vLLM's source (connector/api_compat.py),
for the installed vLLM, the cached wheels of the other checked releases, and doctored copies."""

from __future__ import annotations

import ast
import os
import shutil
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement

from kvferry.common.config import load_config
from kvferry.connector import api_compat
from kvferry.connector.vllm_version import (
    CHECKED_RELEASES,
    SUPPORTED_VLLM,
    UnsupportedVLLM,
    check_vllm_version,
    cpu_mla_rotary_unfixed,
    installed_vllm_version,
    warn_cpu_mla_rotary,
)

REPO = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("KVFERRY_CACHE_DIR", Path.home() / ".cache" / "kvferry")) / "wheels"


# ---- the version range ----

def test_vllm_version_range_is_the_cuda_extra_and_spans_the_checked_releases() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    reqs = [Requirement(r) for r in extras["cuda"]]
    vllm = [r for r in reqs if r.name == "vllm"]
    assert len(vllm) == 1 and str(vllm[0].specifier) == str(Requirement(f"vllm{SUPPORTED_VLLM}").specifier)
    assert all(vllm[0].specifier.contains(v) for v in CHECKED_RELEASES)
    assert not vllm[0].specifier.contains("0.34.0") and not vllm[0].specifier.contains("0.31.0")


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.0+cu129"])
def test_vllm_version_in_the_range_is_logged(version: str, kvf_logs: pytest.LogCaptureFixture) -> None:
    assert check_vllm_version(version, allow_unsupported=False) is True
    assert f"KVFerryConnector in vLLM {version} (kvferry supports vLLM {SUPPORTED_VLLM})" in kvf_logs.text


@pytest.mark.parametrize("version", ["0.34.0", "0.31.0", "0.33.1.dev5+g1234abc", "1.0.0", "not-a-version"])
def test_vllm_version_outside_the_range_is_refused_naming_the_range_and_the_override(version: str) -> None:
    with pytest.raises(UnsupportedVLLM) as e:
        check_vllm_version(version, allow_unsupported=False)
    msg = str(e.value)
    assert "\n" not in msg and f"vLLM {version}" in msg and SUPPORTED_VLLM in msg
    assert "allow_unsupported_vllm: true" in msg


def test_vllm_version_override_starts_with_a_warning(kvf_logs: pytest.LogCaptureFixture) -> None:
    assert load_config({"allow_unsupported_vllm": True}).allow_unsupported_vllm is True
    assert check_vllm_version("0.34.0", allow_unsupported=True) is False
    assert "vLLM 0.34.0 is outside" in kvf_logs.text and "allow_unsupported_vllm is true" in kvf_logs.text


def test_vllm_version_check_runs_when_vllm_builds_the_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry.connector import KVFerryConnector, kvferry_connector

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(kvferry_connector, "installed_vllm_version", lambda: "0.34.0")

    def config(**extra) -> SimpleNamespace:
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            kv_role="kv_both", kv_connector_extra_config={"local_cpu": True, **extra}))
    with pytest.raises(UnsupportedVLLM, match="allow_unsupported_vllm"):
        KVFerryConnector(config(), KVConnectorRole.WORKER)
    KVFerryConnector(config(allow_unsupported_vllm=True), KVConnectorRole.WORKER).shutdown()
    assert installed_vllm_version() in CHECKED_RELEASES  # the vLLM the tests run in is a checked one


# ---- vLLM CPU's rotary op and MLA ----

def test_cpu_mla_rotary_fix_is_asked_for_only_where_the_broken_op_would_run() -> None:
    assert cpu_mla_rotary_unfixed(True, True, [])
    assert cpu_mla_rotary_unfixed(True, True, ["+rms_norm"])
    assert not cpu_mla_rotary_unfixed(True, True, ["-rotary_embedding"])
    assert not cpu_mla_rotary_unfixed(True, True, ["none"])
    assert not cpu_mla_rotary_unfixed(False, True, [])  # a GPU's rotary op is right
    assert not cpu_mla_rotary_unfixed(True, False, [])  # a K/V-head model's query is not strided


def test_cpu_mla_rotary_warning_names_the_flag(kvf_logs: pytest.LogCaptureFixture) -> None:
    def config(mla: bool, ops: list[str]) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(use_mla=mla),
                               compilation_config=SimpleNamespace(custom_ops=ops))
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        assert warn_cpu_mla_rotary(config(True, [])) is False
        return
    assert warn_cpu_mla_rotary(config(True, [])) is True
    assert '--compilation-config \'{"custom_ops": ["-rotary_embedding"]}\'' in kvf_logs.text
    assert warn_cpu_mla_rotary(config(True, ["-rotary_embedding"])) is False
    assert warn_cpu_mla_rotary(config(False, [])) is False


def test_vllm_server_turns_the_rotary_op_off_and_picks_the_reference_backend_for_an_mla_model_on_vllm_cpu(
        tmp_path: Path) -> None:
    """Both for MLA only, and each only where the caller did not choose: the reference MLA backend
    is the one that runs float32 and the same blocks on every CPU (vLLM picks its AMX one, bf16
    only, on a CPU with AMX tiles)."""
    from kvferry.launcher.vllm_proc import VLLMServer

    mla, gqa = tmp_path / "mla", tmp_path / "gqa"
    for d, cfg in ((mla, '{"kv_lora_rank": 512}'), (gqa, '{"num_key_value_heads": 8}')):
        d.mkdir()
        (d / "config.json").write_text(cfg)
    flags = ["--compilation-config", '{"custom_ops": ["-rotary_embedding"]}', "--attention-backend", "CPU_MLA"]
    assert VLLMServer(str(mla), 1, tmp_path / "a.log").args[-4:] == flags
    plain = VLLMServer(str(gqa), 1, tmp_path / "b.log").args
    assert "--compilation-config" not in plain and "--attention-backend" not in plain
    own = VLLMServer(str(mla), 1, tmp_path / "c.log", extra_args=["-O", '{"level": 0}']).args
    assert own[-4:] == ["-O", '{"level": 0}', "--attention-backend", "CPU_MLA"]  # the caller's own config wins
    assert "--compilation-config" not in own
    chosen = VLLMServer(str(mla), 1, tmp_path / "e.log", extra_args=["--attention-backend", "AMX_MLA"]).args
    assert chosen.count("--attention-backend") == 1 and chosen[-2:] == flags[:2]
    hub = VLLMServer("deepseek-ai/DeepSeek-V2-Lite", 1, tmp_path / "d.log").args
    assert "--compilation-config" not in hub and "--attention-backend" not in hub


# ---- the API check ----

def test_api_compat_passes_for_the_installed_vllm() -> None:
    rep = api_compat.check(api_compat.installed_tree())
    assert rep.ok, rep.problems
    assert rep.vllm_version == installed_vllm_version()
    assert rep.checked["imports"] > 20 and rep.checked["fields"] == len(api_compat.FIELDS)


@pytest.mark.parametrize("version", CHECKED_RELEASES)
def test_api_compat_passes_for_each_checked_release_wheel(version: str) -> None:
    """Releases other than the installed one are read from their wheels in the cache
    (`make vllm-compat` downloads them; without one this skips)."""
    if version == installed_vllm_version():
        pytest.skip("the installed vLLM: test_api_compat_passes_for_the_installed_vllm")
    wheels = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        pytest.skip(f"vllm {version}'s wheel is not in {WHEELS}: run make vllm-compat")
    rep = api_compat.check(api_compat.WheelTree(wheels[0]))
    assert rep.vllm_version == version
    assert rep.ok, rep.problems


@pytest.fixture(scope="module")
def vllm_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the installed vLLM's files the check reads."""
    tree = api_compat.installed_tree()
    assert api_compat.check(tree).ok
    root = tmp_path_factory.mktemp("vllm-copy")
    for rel in tree.read_paths:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree.root / rel, root / rel)
    return root


BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
OUTPUT = "vllm/v1/core/sched/output.py"
EVENTS = "vllm/distributed/kv_events.py"
DOCTORED = {
    "new_abstract_method": (
        BASE, '    @abstractmethod\n    def start_load_kv(',
        '    @abstractmethod\n    def flush_kv(self, request_id: str) -> None:\n        pass\n\n'
        '    @abstractmethod\n    def start_load_kv(',
        "does not implement KVConnectorBase_V1.flush_kv"),
    "renamed_hook": (
        BASE, "def get_block_ids_with_load_errors(", "def get_failed_block_ids(",
        "defines get_block_ids_with_load_errors(), which KVConnectorBase_V1 no longer has"),
    "new_parameter": (
        BASE, 'def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any)',
        'def start_load_kv(self, forward_context: "ForwardContext", layer_group: int, **kwargs: Any)',
        ".start_load_kv: vLLM passes a parameter 'layer_group'"),
    "sleep_hook_not_overridden": (
        BASE, "    def shutdown(self):",
        "    @classmethod\n    def supports_sleep_mode(cls, kv_transfer_config) -> bool:\n        return True\n\n"
        "    def shutdown(self):",
        None),  # kvferry overrides it: the doctored copy still passes
    "missing_field": (
        OUTPUT, "    total_num_scheduled_tokens: int", "    num_tokens_total: int",
        "SchedulerOutput.total_num_scheduled_tokens is missing"),
    "field_shape": (
        OUTPUT, "    block_ids: tuple[list[int], ...]\n", "    block_ids: list[int]\n",
        "NewRequestData.block_ids is 'list[int]' in this vLLM"),
    "new_required_event_field": (
        EVENTS, "    block_size: int\n", "    block_size: int\n    group_id: int\n",
        "does not pass BlockStored.group_id, required in this vLLM"),
    "event_batch_field": (
        EVENTS, "    ts: float\n", "    timestamp: float\n",
        "KVEventBatch.ts is missing"),
}


@pytest.mark.parametrize("case", sorted(DOCTORED))
def test_api_compat_fails_on_a_doctored_copy_naming_the_method_or_field(vllm_copy: Path, tmp_path: Path,
                                                                      case: str) -> None:
    path, old, new, expect = DOCTORED[case]
    root = tmp_path / "vllm-doctored"
    shutil.copytree(vllm_copy, root)
    text = (root / path).read_text()
    assert text.count(old) == 1, f"the doctoring of {case} no longer applies to {path}"
    (root / path).write_text(text.replace(old, new))
    rep = api_compat.check(api_compat.DirTree(root))
    if expect is None:
        assert rep.ok, rep.problems
        return
    assert not rep.ok
    assert any(expect in p for p in rep.problems), rep.problems


def test_api_compat_undoctored_copy_passes(vllm_copy: Path) -> None:
    rep = api_compat.check(api_compat.DirTree(vllm_copy))
    assert rep.ok, rep.problems


def test_api_compat_flags_the_sleep_hooks_when_kvferry_would_inherit_them(vllm_copy: Path) -> None:
    """vLLM 0.33's base answers supports_sleep_mode with True and does nothing on unregister /
    restore: a connector without its own would claim sleep support falsely."""
    sources = api_compat.connector_sources()
    tree = sources["connector/kvferry_connector.py"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVFerryConnector")
    cls.body = [n for n in cls.body if getattr(n, "name", "") not in api_compat.NEWER_HOOKS]
    base = vllm_copy / BASE
    root = vllm_copy.parent / "vllm-with-sleep-hooks"
    shutil.copytree(vllm_copy, root, dirs_exist_ok=True)
    (root / BASE).write_text(base.read_text().replace(
        "    def shutdown(self):",
        "    @classmethod\n    def supports_sleep_mode(cls, kv_transfer_config) -> bool:\n        return True\n\n"
        "    def unregister_kv_caches(self) -> None:\n        return\n\n"
        "    def restore_kv_caches(self) -> None:\n        return\n\n    def shutdown(self):"))
    rep = api_compat.check(api_compat.DirTree(root), sources)
    for hook in sorted(api_compat.NEWER_HOOKS):
        assert any(f"must override KVConnectorBase_V1.{hook}" in p for p in rep.problems), rep.problems


def test_api_compat_private_names_each_have_a_test_and_no_other_is_read() -> None:
    assert api_compat.private_name_tests_exist(REPO / "tests") == []
    src = "\n".join(p.read_text() for p in (REPO / "connector").glob("*.py") if p.name != "api_compat.py")
    for name in api_compat.PRIVATE_NAMES:
        assert f".{name}" in src, f"PRIVATE_NAMES lists {name}, which the connector no longer reads"
    # A private base attribute not in the list is a problem naming it.
    sources = api_compat.connector_sources()
    text = (REPO / "connector" / "kvferry_connector.py").read_text().replace(
        "        self.roles = roles(vllm_config)\n", "        self.roles = roles(self._vllm_config)\n")
    sources["connector/kvferry_connector.py"] = ast.parse(text)
    rep = api_compat.check(api_compat.installed_tree(), sources)
    assert any("private KVConnectorBase_V1._vllm_config" in p for p in rep.problems), rep.problems
