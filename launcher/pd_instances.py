"""vLLM servers with KVFerryConnector (prefiller, decoder, kv_both offload): config files and flags."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvferry.common.netutil import advertised, free_port
from kvferry.common.wire.transfer_params import DisaggSpec, to_dict
from kvferry.launcher.vllm_proc import VLLMServer

CONNECTOR = {"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.connector"}


def write_config(path: Path, **keys: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def write_pd_config(path: Path, role: str, **keys: object) -> Path:
    """An LMCache-style config file (the keys of LMCache's prefiller/decoder YAML) for a prefiller
    (`role` "sender") or a decoder ("receiver"); `keys` override the defaults."""
    cfg: dict[str, object] = {"local_cpu": False, "enable_pd": True, "transfer_channel": "nixl", "pd_role": role,
                              "pd_buffer_size": 256 << 20, "pd_buffer_device": "cpu"}
    cfg.update(keys)
    return write_config(path, **cfg)


class Prefiller(VLLMServer):
    """A kv_producer vLLM server; `server` holds VLLMServer options, `keys` config keys."""

    def __init__(self, model: str, log_dir: Path, cores: str | None, conf_dir: Path, port: int | None = None,
                 server: dict | None = None, **keys: object) -> None:
        port = port or free_port()
        self.config_path = write_pd_config(conf_dir / f"prefiller-{port}.yaml", "sender", **keys)
        kw = dict(server or {})
        env = {**kw.pop("env", {}), "KVFERRY_CONFIG_FILE": str(self.config_path)}
        super().__init__(model, port, log_dir / f"vllm-prefiller-{port}.log", cores=cores,
                         kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer"}, env=env, **kw)


class Decoder(VLLMServer):
    """A kv_consumer vLLM server with its receiver's init and alloc ports."""

    def __init__(self, model: str, log_dir: Path, cores: str | None, conf_dir: Path, port: int | None = None,
                 host: str = "127.0.0.1", init_port: int | None = None, alloc_port: int | None = None,
                 server: dict | None = None, advertise_host: str | None = None, tp_size: int = 1,
                 **keys: object) -> None:
        """`host`: where the receiver binds (pd_peer_host); `advertise_host`: the address prefillers
        dial (pd_peer_advertise_host; default: `host`, or this machine's address for a wildcard).
        `tp_size` > 1: one receiver per TP rank, on `init_ports` / `alloc_ports` (the first are
        `init_port` / `alloc_port`); the server needs --tensor-parallel-size in `server`'s extra_args."""
        port = port or free_port()
        self.host, self.init_port, self.alloc_port = host, init_port or free_port(), alloc_port or free_port()
        self.init_ports = [self.init_port] + [free_port() for _ in range(tp_size - 1)]
        self.alloc_ports = [self.alloc_port] + [free_port() for _ in range(tp_size - 1)]
        ports = ({"pd_peer_init_port": self.init_port, "pd_peer_alloc_port": self.alloc_port} if tp_size == 1 else
                 {"pd_peer_init_port": self.init_ports, "pd_peer_alloc_port": self.alloc_ports})
        self.receiver_host = advertised(host, advertise_host, "the decoder's receiver (pd_peer_host)")
        if advertise_host:
            keys = {**keys, "pd_peer_advertise_host": advertise_host}
        self.config_path = write_pd_config(conf_dir / f"decoder-{port}.yaml", "receiver", pd_peer_host=host,
                                           **ports, **keys)
        kw = dict(server or {})
        env = {**kw.pop("env", {}), "KVFERRY_CONFIG_FILE": str(self.config_path)}
        super().__init__(model, port, log_dir / f"vllm-decoder-{port}.log", cores=cores,
                         kv_transfer_config={**CONNECTOR, "kv_role": "kv_consumer"}, env=env, **kw)

    def disagg_spec(self) -> dict:
        """What a prefill request's kv_transfer_params.disagg_spec names for this decoder."""
        return to_dict(DisaggSpec(self.receiver_host, list(self.init_ports), list(self.alloc_ports)))
