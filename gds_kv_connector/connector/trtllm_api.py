"""The only module that imports tensorrt_llm.

It binds the connector base classes and data types to TensorRT-LLM's own when the package is
importable (new module path first, then the pre-1.4 one) and to the in-repo mirror otherwise,
so the connector runs unchanged inside TensorRT-LLM and in CPU-only tests.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

_PATHS = ("tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
          "tensorrt_llm._torch.pyexecutor.kv_cache_connector")
_NAMES = ("KvCacheConnectorScheduler", "KvCacheConnectorWorker", "SchedulerOutput", "RequestData")
# Names only the newest manager has (the prefix-reservation protocol): None where this version lacks them.
_OPTIONAL = ("PrefixLoad",)


def _trtllm_present() -> bool:
    if "tensorrt_llm" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("tensorrt_llm") is not None
    except (ImportError, ValueError):
        return False


def _bind() -> tuple[str, dict]:
    if not _trtllm_present():
        from gds_kv_connector.connector import trtllm_mirror
        return "gds_kv_connector.connector.trtllm_mirror", {n: getattr(trtllm_mirror, n) for n in _NAMES + _OPTIONAL}
    errors = []
    for path in _PATHS:
        try:
            mod = importlib.import_module(path)
        except ImportError as exc:
            errors.append(f"{path}: {exc}")
            continue
        missing = [n for n in _NAMES if not hasattr(mod, n)]
        if missing:
            errors.append(f"{path}: lacks {', '.join(missing)}")
            continue
        return path, {n: getattr(mod, n, None) for n in _NAMES + _OPTIONAL}
    raise ImportError("tensorrt_llm is installed but its KV-cache connector API could not be imported:\n  "
                      + "\n  ".join(errors))


SOURCE, _bound = _bind()
KvCacheConnectorScheduler = _bound["KvCacheConnectorScheduler"]
KvCacheConnectorWorker = _bound["KvCacheConnectorWorker"]
SchedulerOutput = _bound["SchedulerOutput"]
RequestData = _bound["RequestData"]
PrefixLoad = _bound["PrefixLoad"]
BAD_PAGE_INDEX = -1


def has_prefix_reservations() -> bool:
    """Whether this TensorRT-LLM's manager can call the prefix-reservation protocol (its
    ``SchedulerOutput`` carries ``prefix_loads``); the connector implements the protocol either way,
    and a manager without it never calls it."""
    fields = getattr(SchedulerOutput, "__dataclass_fields__", {})
    return "prefix_loads" in fields


# TensorRT-LLM's own deadline for a connector transfer: module constants of py_executor (the second
# is an earlier name), configurable as kv_connector_config.transfer_timeout_sec where PR #19369 landed.
_EXECUTOR_MODULE = "tensorrt_llm._torch.pyexecutor.py_executor"
_TIMEOUT_CONSTANTS = ("_KV_CONNECTOR_TRANSFER_TIMEOUT_SEC", "_KV_CONNECTOR_LOAD_TIMEOUT_SEC")


def transfer_timeout_s(llm_args: object) -> float | None:
    """How long TensorRT-LLM lets a connector transfer run before it fails the process, where this
    version says: ``kv_connector_config.transfer_timeout_sec``, else the executor module's constant
    (read only if the executor already imported it); None when neither is found."""
    value = getattr(getattr(llm_args, "kv_connector_config", None), "transfer_timeout_sec", None)
    if not _positive_number(value):
        executor = sys.modules.get(_EXECUTOR_MODULE)
        value = next((v for v in (getattr(executor, n, None) for n in _TIMEOUT_CONSTANTS) if _positive_number(v)),
                     None)
    return float(value) if value is not None else None


def control_grace_s(llm_args: object) -> float | None:
    """How long TensorRT-LLM waits for a connector's transfers after a cancel or at shutdown before
    it fails the process (``kv_connector_config.control_grace_sec``), where this version has it."""
    value = getattr(getattr(llm_args, "kv_connector_config", None), "control_grace_sec", None)
    return float(value) if _positive_number(value) else None


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def mpi_rank() -> int:
    """This process's global rank: TensorRT-LLM's view when available, else the launcher's env."""
    if SOURCE != "gds_kv_connector.connector.trtllm_mirror":
        try:
            from tensorrt_llm._utils import mpi_rank as _rank
            return int(_rank())
        except (ImportError, AttributeError):
            pass
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0
