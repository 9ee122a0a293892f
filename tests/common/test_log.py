"""common/log.py: importing kvferry configures no logging; entry points and the connector do.

Each case runs in a fresh interpreter: configuring logging is process-wide, and this one's
loggers must stay as pytest left them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAD = """
import logging
from types import SimpleNamespace as NS
from kvferry.common import log
kv = logging.getLogger("kvferry")
def state():
    return (len(kv.handlers), kv.propagate, logging.getLevelName(kv.level))
"""


def run(body: str, **env: str) -> None:
    import os
    environ = {k: v for k, v in os.environ.items()
               if k not in ("KVFERRY_LOG_LEVEL", "LMCACHE_LOG_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL")}
    done = subprocess.run([sys.executable, "-c", HEAD + textwrap.dedent(body)], env={**environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_importing_kvferry_configures_no_logging() -> None:
    run("""
        import kvferry.common.zsock, kvferry.common.netutil, kvferry.controller.server, kvferry.launcher.cli
        import kvferry.launcher.lm_server, kvferry.receiver.kv_receiver
        assert state() == (0, True, "NOTSET"), state()
        assert log.get_logger("x").name == "kvferry.x" and log.get_logger("kvferry.y").name == "kvferry.y"
        assert state() == (0, True, "NOTSET"), state()
    """, KVFERRY_LOG_LEVEL="DEBUG")


def test_an_entry_point_configures_once_at_the_env_level() -> None:
    run("""
        log.configure_logging()
        log.configure_logging()
        assert state() == (1, False, "WARNING"), state()
    """, KVFERRY_LOG_LEVEL="warning")
    run("""
        log.configure_logging()
        assert state() == (1, False, "DEBUG"), state()
    """, KVFERRY_LOG_LEVEL="nonsense", LMCACHE_LOG_LEVEL="DEBUG")
    run("""
        log.configure_logging()
        assert state() == (1, False, "INFO"), state()
    """)


@pytest.mark.parametrize("case", ["on", "off", "theirs", "env"])
def test_inside_vllm_kvferry_follows_vllms_logging_settings(case: str) -> None:
    body = {
        # vLLM's logging on: kvferry's handler, at vLLM's level unless KVFERRY_LOG_LEVEL says otherwise.
        "on": """
            log.configure_in_vllm(NS(configure_logging=True, log_level="DEBUG"))
            assert state() == (1, False, "DEBUG"), state()
        """,
        # vLLM's logging off: nothing set; kvferry's records go to the root logger the user configures.
        "off": """
            log.configure_in_vllm(NS(configure_logging=False, log_level="DEBUG"))
            assert state() == (0, True, "NOTSET"), state()
        """,
        # A logging config file that names `kvferry` is left as it is.
        "theirs": """
            mine = logging.NullHandler()
            kv.addHandler(mine)
            log.configure_in_vllm(NS(configure_logging=True, log_level="DEBUG"))
            assert kv.handlers == [mine] and kv.propagate, state()
        """,
        # No LoggingConfig at hand: vLLM's environment variables.
        "env": """
            log.configure_in_vllm(None)
            assert state() == (0, True, "NOTSET"), state()
        """,
    }[case]
    env = {"env": {"VLLM_CONFIGURE_LOGGING": "0"}, "on": {}}.get(case, {})
    run(body, **env)
    if case == "on":
        run("""
            log.configure_in_vllm(NS(configure_logging=True, log_level="DEBUG"))
            assert state() == (1, False, "ERROR"), state()
        """, KVFERRY_LOG_LEVEL="ERROR")
