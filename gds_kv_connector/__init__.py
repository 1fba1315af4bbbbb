"""gds-kv-connector: a GPUDirect Storage KV-cache connector for TensorRT-LLM.

Point TensorRT-LLM's ``kv_connector_config`` at ``connector_module: gds_kv_connector`` with
``GdsKvConnectorScheduler`` / ``GdsKvConnectorWorker``.
"""

from .scheduler import GdsKvConnectorScheduler
from .worker import GdsKvConnectorWorker

__version__ = "0.1.0"
__all__ = ["GdsKvConnectorScheduler", "GdsKvConnectorWorker", "__version__"]
