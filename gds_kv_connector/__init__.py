"""gds-kv-connector: a GPUDirect Storage KV-cache connector for TensorRT-LLM.

Point TensorRT-LLM's ``kv_connector_config`` at ``connector_module: gds_kv_connector`` with
``GdsKvConnectorScheduler`` / ``GdsKvConnectorWorker``.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["GdsKvConnectorScheduler", "GdsKvConnectorWorker", "__version__"]


def __getattr__(name: str) -> Any:
    """The two classes, imported on first use: ``gds-kv`` commands that never touch a connector (help,
    settings, stats, gc, verify) do not pay for importing torch; TensorRT-LLM's loader gets them by
    ``getattr(module, name)``, which lands here."""
    if name == "GdsKvConnectorScheduler":
        from gds_kv_connector.connector.scheduler import GdsKvConnectorScheduler
        return GdsKvConnectorScheduler
    if name == "GdsKvConnectorWorker":
        from gds_kv_connector.connector.worker import GdsKvConnectorWorker
        return GdsKvConnectorWorker
    raise AttributeError(f"module 'gds_kv_connector' has no attribute {name!r}")
