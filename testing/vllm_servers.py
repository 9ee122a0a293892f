"""vLLM servers for tests of the offload and P2P tiers: a kv_both instance with the tiers its
keys configure, and LMCache's P2P keys on free ports."""

from __future__ import annotations

from pathlib import Path

from kvferry.common.netutil import free_port
from kvferry.launcher.pd_instances import CONNECTOR, write_config
from kvferry.launcher.vllm_proc import VLLMServer


class OffloadServer(VLLMServer):
    """A kv_both vLLM server: the offload tiers that `keys` configure."""

    def __init__(self, model: str, log_dir: Path, cores: str | None, conf_dir: Path, port: int | None = None,
                 server: dict | None = None, **keys: object) -> None:
        port = port or free_port()
        self.config_path = write_config(conf_dir / f"offload-{port}.yaml", **{"chunk_size": 256, **keys})
        kw = dict(server or {})
        env = {**kw.pop("env", {}), "KVFERRY_CONFIG_FILE": str(self.config_path)}
        super().__init__(model, port, log_dir / f"vllm-offload-{port}.log", cores=cores,
                         kv_transfer_config={**CONNECTOR, "kv_role": "kv_both"}, env=env, **kw)


def p2p_keys(host: str = "127.0.0.1") -> dict[str, object]:
    """LMCache's P2P keys (examples/lmcache-configs/p2p_example1.yaml) on free ports (add a
    controller's `worker_keys`)."""
    return {"enable_p2p": True, "p2p_host": host, "p2p_init_ports": free_port(), "p2p_lookup_ports": free_port(),
            "transfer_channel": "nixl"}
