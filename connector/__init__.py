"""vLLM adapter: ``kv_connector_module_path: kvferry.connector``, ``kv_connector: KVFerryConnector``.

``KVFerryConnector`` is imported when first asked for (vLLM's ``getattr`` on this module), so the
GPU-free API check (``kvferry.connector.api_compat``) runs where vLLM is not installed.
"""

from typing import Any

__all__ = ["KVFerryConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVFerryConnector":
        from kvferry.connector.kvferry_connector import KVFerryConnector

        return KVFerryConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
