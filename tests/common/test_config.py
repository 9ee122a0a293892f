"""Config loading: LMCache's example files, precedence, and one-line errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.common.config import ConfigError, KVFerryConfig, load_config

LMCACHE_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "lmcache-configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_seed_files_are_all_here() -> None:
    names = {p.name for p in LMCACHE_CONFIGS}
    for needed in ("lmcache-prefiller-config.yaml", "lmcache-decoder-config.yaml", "p2p_example1.yaml",
                   "redis.yaml", "redis-sentinel.yaml", "mooncake-config.yaml", "nixl-storage-posix.yaml"):
        assert needed in names


@pytest.mark.parametrize("path", LMCACHE_CONFIGS, ids=lambda p: p.name)
def test_every_seed_file_loads_via_lmcache_env(path: Path) -> None:
    cfg = load_config(env={"LMCACHE_CONFIG_FILE": str(path)})
    assert isinstance(cfg, KVFerryConfig)


def test_seed_decoder_and_prefiller_meaning() -> None:
    configs = LMCACHE_CONFIGS[0].parent
    dec = load_config(env={"LMCACHE_CONFIG_FILE": str(configs / "lmcache-decoder-config.yaml")})
    assert (dec.enable_pd, dec.pd_role, dec.pd_peer_host) == (True, "receiver", "localhost")
    assert dec.ports("pd_peer_init_port") == [7300] and dec.ports("pd_peer_alloc_port") == [7400]
    assert dec.pd_buffer_size == 1 << 30 and dec.pd_buffer_device == "cuda" and dec.local_cpu is False
    pre = load_config(env={"KVFERRY_CONFIG_FILE": str(configs / "lmcache-prefiller-config.yaml")})
    assert (pre.pd_role, pre.pd_proxy_port, pre.transfer_channel) == ("sender", 7500, "nixl")
    p2p = load_config(env={"LMCACHE_CONFIG_FILE": str(configs / "p2p_example2.yaml")})
    assert p2p.extra_config == {"lookup_backoff_time": 0.001}
    assert p2p.lmcache_instance_id == "lmcache_instance_2" and p2p.max_local_cpu_size == 100.0


def test_precedence_file_then_env_then_dict(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 16\nmax_local_cpu_size: 2\nlocal_cpu: true\n")
    env = {"LMCACHE_CONFIG_FILE": path, "LMCACHE_CHUNK_SIZE": "32", "LMCACHE_MAX_LOCAL_CPU_SIZE": "3"}
    cfg = load_config(env=env)
    assert cfg.chunk_size == 32 and cfg.max_local_cpu_size == 3.0
    cfg = load_config({"chunk_size": 64}, env={**env, "KVFERRY_CHUNK_SIZE": "48"})
    assert cfg.chunk_size == 64 and cfg.max_local_cpu_size == 3.0
    assert load_config(env={**env, "KVFERRY_CHUNK_SIZE": "48"}).chunk_size == 48


def test_kvferry_file_wins_over_lmcache_file(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text("chunk_size: 8\n")
    b = tmp_path / "b.yaml"
    b.write_text("chunk_size: 512\n")
    assert load_config(env={"LMCACHE_CONFIG_FILE": str(a), "KVFERRY_CONFIG_FILE": str(b)}).chunk_size == 512


def test_env_values_are_typed() -> None:
    cfg = load_config(env={"LMCACHE_LOCAL_CPU": "False", "LMCACHE_REMOTE_URL": "lm://localhost:65432",
                           "KVFERRY_PD_KV_READY_TIMEOUT": "2", "LMCACHE_REMOTE_SERDE": "naive"})
    assert cfg.local_cpu is False and cfg.remote_url == "lm://localhost:65432"
    assert cfg.pd_kv_ready_timeout == 2.0 and isinstance(cfg.pd_kv_ready_timeout, float)
    assert load_config(env={"LMCACHE_REMOTE_URL": "None"}).remote_url is None


def test_vllm_extra_config_of_the_seed_is_accepted() -> None:
    cfg = load_config({"discard_partial_chunks": False, "lmcache_rpc_port": "consumer1",
                       "lmcache.chunk_size": 128}, env={})
    assert cfg.chunk_size == 128 and cfg.lmcache_rpc_port == "consumer1"


def one_line_error(**kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\nchunk_sise: 8\n")
    msg = one_line_error(env={"LMCACHE_CONFIG_FILE": path})
    assert "chunk_sise" in msg and path in msg and "chunk_size" in msg  # suggests the right key


def test_unknown_key_in_dict_and_kvferry_env() -> None:
    assert "bogus" in one_line_error(extra={"bogus": 1}, env={})
    assert "KVFERRY_BOGUS" in one_line_error(env={"KVFERRY_BOGUS": "1"})


def test_kvferry_switches_are_not_config_keys() -> None:
    env = {"KVFERRY_NATIVE_COPY": "0", "KVFERRY_CACHE_DIR": "/tmp/x", "KVFERRY_LOG_LEVEL": "DEBUG",
           "KVFERRY_TEST_LOG_DIR": "/tmp/l", "KVFERRY_BENCH_DEBUG": "1", "KVFERRY_LOCUST_MODEL": "tiny",
           "KVFERRY_LOCUST_MAX_TOKENS": "8"}
    assert load_config(env=env).chunk_size == 256


def test_unknown_lmcache_env_is_tolerated(kvf_logs: pytest.LogCaptureFixture) -> None:
    cfg = load_config(env={"LMCACHE_SOMETHING_ELSE": "1", "LMCACHE_LOG_LEVEL": "DEBUG"})
    assert cfg.chunk_size == 256
    assert "LMCACHE_SOMETHING_ELSE" in kvf_logs.text


def test_wrong_types_name_key_and_source(tmp_path: Path) -> None:
    msg = one_line_error(env={"LMCACHE_CONFIG_FILE": write(tmp_path, "chunk_size: lots\n")})
    assert "chunk_size" in msg and "expected int" in msg
    msg = one_line_error(env={"LMCACHE_CHUNK_SIZE": "abc"})
    assert "chunk_size" in msg and "LMCACHE_CHUNK_SIZE" in msg
    msg = one_line_error(extra={"local_cpu": "yes please"}, env={})
    assert "local_cpu" in msg and "kv_connector_extra_config" in msg


@pytest.mark.parametrize("text,key,fix", [
    ("enable_pd: true\n", "pd_role", "set pd_role"),
    ("enable_pd: true\npd_role: receiver\npd_peer_host: localhost\npd_peer_init_port: 7300\n",
     "pd_peer_alloc_port", "pd_peer_alloc_port"),
    ("pd_role: sender\n", "enable_pd", "set enable_pd"),
    ("enable_pd: true\npd_role: prefiller\n", "pd_role", "'sender'"),
    ("enable_pd: true\npd_role: sender\ntransfer_channel: mooncake\n", "transfer_channel", "use 'nixl'"),
    ("enable_pd: true\npd_role: sender\npd_buffer_device: tpu\n", "pd_buffer_device", "'cpu'"),
    ("enable_pd: true\npd_role: sender\npd_buffer_size: 0\n", "pd_buffer_size", "positive"),
    ("enable_p2p: true\np2p_host: h\np2p_init_ports: 1\np2p_lookup_ports: 2\n", "enable_controller",
     "set enable_controller"),
    ("local_disk: /tmp/x\n", "max_local_disk_size", "set max_local_disk_size"),
    ("remote_url: localhost:6379\n", "remote_url", "scheme://host:port"),
    ("remote_url: ftp://h:1\n", "remote_url", "redis"),
    ("remote_serde: gzip\n", "remote_serde", "naive"),
    ("chunk_size: 0\n", "chunk_size", "positive"),
    ("pd_proxy_port: 70000\n", "pd_proxy_port", "1-65535"),
    ("enable_controller: true\nlmcache_worker_ports: 8500\n", "controller_pull_url", "localhost:8300"),
    ("enable_controller: true\ncontroller_pull_url: localhost:8300\nlmcache_worker_ports: 8500\n", "enable_p2p",
     "p2p_init_ports"),
    ("enable_p2p: true\nenable_controller: true\np2p_host: localhost\ncontroller_pull_url: localhost:8300\n"
     "p2p_init_ports: 8200\np2p_lookup_ports: 8201\nlmcache_worker_ports: 8500\n", "controller_reply_url",
     "localhost:8400"),
    ("enable_p2p: true\nenable_controller: true\np2p_host: localhost\ncontroller_pull_url: localhost:8300\n"
     "controller_reply_url: localhost:8400\np2p_init_ports: [8200, 8202]\np2p_lookup_ports: 8201\n"
     "lmcache_worker_ports: 8500\n", "p2p_lookup_ports", "one of each per TP rank"),
])
def test_contradictions_name_key_and_fix(tmp_path: Path, text: str, key: str, fix: str) -> None:
    msg = one_line_error(env={"LMCACHE_CONFIG_FILE": write(tmp_path, text)})
    assert key in msg and fix in msg, msg


def test_missing_and_broken_files_name_the_variable(tmp_path: Path) -> None:
    msg = one_line_error(env={"LMCACHE_CONFIG_FILE": str(tmp_path / "nope.yaml")})
    assert "LMCACHE_CONFIG_FILE" in msg and "nope.yaml" in msg
    msg = one_line_error(env={"KVFERRY_CONFIG_FILE": write(tmp_path, "a: [1,\n")})
    assert "KVFERRY_CONFIG_FILE" in msg and "YAML" in msg
    msg = one_line_error(env={"KVFERRY_CONFIG_FILE": write(tmp_path, "- 1\n- 2\n")})
    assert "mapping" in msg


def test_port_lists_for_tensor_parallel() -> None:
    cfg = load_config({"enable_pd": True, "pd_role": "receiver", "pd_peer_host": "h",
                       "pd_peer_init_port": [7300, 7301], "pd_peer_alloc_port": [7400, 7401]}, env={})
    assert cfg.ports("pd_peer_alloc_port") == [7400, 7401]
    msg = one_line_error(extra={"enable_pd": True, "pd_role": "receiver", "pd_peer_host": "h",
                                "pd_peer_init_port": [7300, 7301], "pd_peer_alloc_port": 7400}, env={})
    assert "pd_peer_alloc_port" in msg and "TP rank" in msg


# Keys whose only accepted value is what kvferry always does (validated in config.py, read nowhere else).
_CHECKED_NOT_READ = {"transfer_channel"}  # only 'nixl' is accepted, and the PD path is always NIXL
# Read only to word NIXL storage's refusal (engine/tiers/nixl_storage.py); otherwise ignored and logged.
_READ_TO_REFUSE = {"nixl_buffer_device"}
_LIBRARY = ("buffer", "common", "connector", "controller", "engine", "kernels", "proxy", "receiver", "sender")


def _library_reads(key: str) -> bool:
    import re
    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(rf"\b{key}\b")
    return any(pattern.search(p.read_text(encoding="utf-8")) for d in _LIBRARY for p in (root / d).rglob("*.py")
               if p != root / "common" / "config.py")


def test_every_key_nothing_reads_is_in_the_ignored_list() -> None:
    """A key the library never reads must be in IGNORED_KEYS (so it is logged), and only those."""
    from kvferry.common.config import FIELD_TYPES, IGNORED_KEYS
    unread = {k for k in FIELD_TYPES if not _library_reads(k)} - _CHECKED_NOT_READ
    assert unread | _READ_TO_REFUSE == set(IGNORED_KEYS)
    for key in ("cache_policy", "discard_partial_chunks", "pre_caching_hash_algorithm", "enable_async_loading",
                "save_decode_cache", "nixl_buffer_size", "nixl_buffer_device"):
        assert key in IGNORED_KEYS


def test_ignored_keys_are_logged_once_each_with_the_reason(monkeypatch: pytest.MonkeyPatch,
                                                          kvf_logs: pytest.LogCaptureFixture) -> None:
    import logging

    from kvferry.common import config
    monkeypatch.setattr(config, "_logged_ignored", set())
    kvf_logs.set_level(logging.INFO, logger="kvferry")
    extra = {"cache_policy": "LFU", "discard_partial_chunks": True, "nixl_buffer_size": 1 << 20}
    load_config(extra, env={"LMCACHE_SAVE_DECODE_CACHE": "true"})
    load_config(extra, env={})  # a second load in the same process logs nothing again
    lines = [r.getMessage() for r in kvf_logs.records if "ignored by kvferry" in r.getMessage()]
    assert len(lines) == 4, lines
    by_key = {line.split()[2]: line for line in lines}
    assert "use save_unfull_chunk" in by_key["discard_partial_chunks"]
    assert "pd_buffer_size" in by_key["nixl_buffer_size"] and "LRU" in by_key["cache_policy"]
    assert "env LMCACHE_SAVE_DECODE_CACHE" in by_key["save_decode_cache"]
    assert "kv_connector_extra_config" in by_key["cache_policy"]


def test_unset_ignored_keys_log_nothing(monkeypatch: pytest.MonkeyPatch, kvf_logs: pytest.LogCaptureFixture) -> None:
    import logging

    from kvferry.common import config
    monkeypatch.setattr(config, "_logged_ignored", set())
    kvf_logs.set_level(logging.INFO, logger="kvferry")
    load_config({"chunk_size": 16}, env={})
    assert "ignored by kvferry" not in kvf_logs.text


def test_one_list_of_schemes_and_serdes() -> None:
    """The config accepts exactly what the tiers open plus LMCache's values they refuse at start."""
    from kvferry.common import config
    from kvferry.engine.remote import backends as remote_store
    from kvferry.engine.remote import redis_settings
    from kvferry.engine.remote import serde as remote_serde
    assert remote_store.SCHEMES is config.REMOTE_SCHEMES
    assert redis_settings.REDIS_SCHEMES is config.REDIS_SCHEMES
    assert set(remote_serde.FORMATS) == set(config.SERDES)
    for scheme in config.REMOTE_SCHEMES + config.LMCACHE_ONLY_SCHEMES:
        load_config({"remote_url": f"{scheme}://h:1"}, env={})
    for serde in config.SERDES:
        load_config({"remote_serde": serde}, env={})
    for scheme in config.LMCACHE_ONLY_SCHEMES:
        with pytest.raises(remote_store.RemoteError, match="kvferry has no .* client: use"):
            remote_store.parse_url(f"{scheme}://h:1")
