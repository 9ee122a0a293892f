"""vLLM adapter: ``kv_connector_module_path: kvferry.connector``, ``kv_connector: KVFerryConnector``."""

from kvferry.connector.kvferry_connector import KVFerryConnector

__all__ = ["KVFerryConnector"]
