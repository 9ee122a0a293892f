"""One exception root: every error kvferry defines derives from KVFerryError and one kind, and
keeps its builtin base so handlers written for it still catch it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from kvferry.common.errors import BadDataError, ConfigurationError, KVFerryError, UnavailableError

FOLDERS = ("buffer", "common", "connector", "controller", "engine", "kernels", "launcher", "proxy", "receiver",
           "sender")
# Control-flow signals internal to one module, never raised to a caller.
INTERNAL = {"kvferry.engine.remote.lm.lm_store.Unauthorized", "kvferry.engine.remote.lm.lm_store.Closing",
            "kvferry.proxy.openai.errors.ProxyError",
            "kvferry.sender.errors.ReceiverRestarted"}


def kvferry_exceptions() -> list[type]:
    found = []
    for folder in FOLDERS:
        pkg = importlib.import_module(f"kvferry.{folder}")
        for info in pkgutil.walk_packages(pkg.__path__, f"kvferry.{folder}."):  # subpackages too
            if info.name.endswith("__main__"):
                continue
            mod = importlib.import_module(info.name)
            for _, obj in inspect.getmembers(mod, inspect.isclass):
                if issubclass(obj, BaseException) and obj.__module__ == info.name:
                    found.append(obj)
    return found


def test_every_error_has_the_one_root_and_a_kind() -> None:
    errors = [e for e in kvferry_exceptions() if f"{e.__module__}.{e.__qualname__}" not in INTERNAL]
    assert len(errors) > 20, [e.__name__ for e in errors]
    kinds = (ConfigurationError, BadDataError, UnavailableError)
    strays = [f"{e.__module__}.{e.__qualname__}" for e in errors
              if e.__module__ != "kvferry.common.errors" and not issubclass(e, KVFerryError)]
    assert not strays, f"errors outside the KVFerryError root: {strays}"
    unkinded = [e.__name__ for e in errors if e.__module__ != "kvferry.common.errors"
                and not issubclass(e, kinds)]
    assert not unkinded, unkinded


def test_builtin_bases_still_catch_them() -> None:
    from kvferry.buffer.pd_buffer import ReservationGone
    from kvferry.common.config import ConfigError
    from kvferry.engine.remote.serde import ForgedError
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, ConfigurationError)
    assert issubclass(ReservationGone, RuntimeError) and issubclass(ReservationGone, UnavailableError)
    assert issubclass(ForgedError, ValueError) and issubclass(ForgedError, BadDataError)
