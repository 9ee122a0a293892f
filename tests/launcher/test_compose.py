"""deploy/compose/ (LMCache's Docker Compose examples rewritten for kvferry) cannot rot: with no Docker
engine here, every service's command is parsed by the real CLI it names (kvferry-server,
kvferry-proxy, vLLM's server, mooncake_master's flag list), every mounted config file loads with
kvferry's config and store checks, and every vLLM role matches its config."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import yaml

from kvferry.common.config import load_config
from kvferry.engine.remote import mooncake_settings
from kvferry.engine.remote.backends import parse_url
from kvferry.launcher.services import mooncake_master_binary

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose"
FILES = sorted(COMPOSE.glob("*/docker-compose.yaml"))


class _Parsed(Exception):
    pass


def _parse_only(main, argv: list[str]) -> argparse.Namespace:  # noqa: ANN001 - a CLI's main()
    """`main(argv)` up to its argparse parse (a bad flag is SystemExit 2), without running it."""
    real = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        raise _Parsed(real(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), pytest.raises(_Parsed) as e:
        main(argv)
    return e.value.args[0]


def _config_file(service: dict, compose: Path) -> Path | None:
    """The host file the service's KVFERRY_CONFIG_FILE names, through its volumes."""
    env = dict(e.split("=", 1) for e in service.get("environment", []))
    inside = env.get("KVFERRY_CONFIG_FILE")
    if inside is None:
        return None
    for vol in service.get("volumes", []):
        host, _, target = vol.partition(":")
        if target == inside:
            return compose.parent / host
    raise AssertionError(f"KVFERRY_CONFIG_FILE {inside} is not a mounted file")


def _vllm(argv: list[str], cfg_path: Path | None) -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvferry.connector.roles import offload_wanted, store_pd

    assert argv[:2] == ["vllm", "serve"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", *argv[2:]])
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert (ktc["kv_connector"], ktc["kv_connector_module_path"]) == ("KVFerryConnector", "kvferry.connector")
    assert args.port and cfg_path is not None
    cfg = load_config(path=str(cfg_path), env={})
    role = ktc["kv_role"]
    assert offload_wanted(cfg, role) and (role == "kv_both" or store_pd(cfg, role) or cfg.enable_pd), role
    if cfg.remote_url:
        parse_url(cfg.remote_url)
        mooncake_settings.from_config(cfg)


def _mooncake_master(argv: list[str]) -> None:
    exe = mooncake_master_binary()
    if exe is None:
        pytest.skip("mooncake_master not installed")
    helptext = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30).stdout
    for arg in argv[1:]:
        if arg.startswith("-"):
            name = arg.lstrip("-").split("=", 1)[0]
            assert f"-{name} (" in helptext, f"mooncake_master has no flag -{name}"


@pytest.mark.parametrize("compose", FILES, ids=lambda p: p.parent.name)
def test_every_command_flag_and_config_key_exists(compose: Path) -> None:
    from kvferry.launcher import lm_server
    from kvferry.proxy import options

    services = yaml.safe_load(compose.read_text())["services"]
    assert (compose.parent.parent / "Dockerfile").exists()
    for name, service in services.items():
        argv = [*service.get("entrypoint", []), *service.get("command", [])]
        cfg_path = _config_file(service, compose)
        if argv[0] == "kvferry-server":
            args = _parse_only(lm_server.main, argv[1:])
            assert args.device == "cpu" and 0 < args.port < 65536
        elif argv[0] == "kvferry-proxy":
            options.parse(argv[1:])
        elif argv[0] == "vllm":
            _vllm(argv, cfg_path)
        elif argv[0] == "mooncake_master":
            _mooncake_master(argv)
        elif argv[:2] == ["kvferry", "join"]:
            _join(argv, service, compose)
        elif argv[0] == "etcd":
            _etcd(argv)
        else:
            raise AssertionError(f"{compose}: service {name} runs {argv[0]!r}, not a kvferry, vLLM or Mooncake command")


def test_both_seed_deployments_are_here() -> None:
    assert {p.parent.name for p in FILES} == {"lm-server", "mooncake-pd", "multihost"}


def _join(argv: list[str], service: dict, compose: Path) -> None:
    """`kvferry join`: its flags parse, its --config file (through the volumes) loads and holds only
    what join takes from it, and it joins through etcd with the cluster secret."""
    from kvferry.common.discovery import sources as discovery
    from kvferry.launcher import cli
    args = _parse_only(cli.main, argv[1:])
    assert args.cmd == "join" and args.role in ("prefiller", "decoder")
    discovery.parse_target(args.discovery)
    assert args.cluster_secret_file and args.cluster_secret_file.startswith("/run/secrets/")
    assert args.cluster_secret_file.rsplit("/", 1)[1] in service["secrets"]
    mounts = {target: host for host, _, target in (v.partition(":") for v in service["volumes"])}
    cfg = compose.parent / mounts[args.config]
    load_config(path=str(cfg), env={})
    assert set(yaml.safe_load(cfg.read_text())) <= {"pd_buffer_size", "pd_buffer_device", "chunk_size",
                                                    "pd_chunk_format"}


def _etcd(argv: list[str]) -> None:
    from kvferry.launcher.services import etcd_binary
    exe = etcd_binary()
    if exe is None:
        pytest.skip("etcd not installed (make etcd)")
    helptext = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30).stdout
    for arg in argv[1:]:
        if arg.startswith("--"):
            assert f"  {arg} " in helptext or f"  {arg}\n" in helptext, f"etcd has no flag {arg}"
