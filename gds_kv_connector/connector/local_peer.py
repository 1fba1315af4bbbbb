"""The in-process link between a scheduler and the worker of the same owner.

The scheduler is built from ``llm_args`` alone, but keys depend on the KV pool the worker
registers (dtype, layers, block bytes), and saves of a request that finishes in an idle
iteration must reach the worker without waiting for a metadata round.  Under attention DP and
on TP rank 0 both live in one process; they find each other here by their shared ``llm_args``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from gds_kv_connector.format.keys import PoolGeometry
from gds_kv_connector.transfer.jobs import SaveOp


@dataclass
class PeerInfo:
    geometry: PoolGeometry
    fingerprints: tuple[bytes, ...]  # one per TP shard (one entry when attention is not sharded)
    block_bytes: int
    deliver_saves: Callable[[list[SaveOp]], None]
    # The worker's TransferManager.fence: request_reset takes a reset request's queued transfers out
    # at once (wait=False); the worker's start_load_kv waits for its running ones before the forward.
    fence: Callable[..., None]
    # The worker's TransferManager.cancel_loads: cancel_load of a whole offer already handed over
    # stops its load at once, since TensorRT-LLM gives a cancelled request's transfers a short grace.
    cancel_loads: Callable[..., None]
    stats: Any
    # The worker's view of its own shard: the scheduler matches through it, so a block this process
    # saved is found in its in-memory index instead of with a stat(2) per key.
    pool: Any = None
    # The worker's load and forward measurements (load_policy.LoadEstimates) that the scheduler's
    # TLLM_GDS_KV_LOAD_POLICY decides from; None where the policy is always (nothing is measured).
    estimates: Any = None


_lock = threading.Lock()
# id(llm_args) -> (llm_args, info); holding llm_args keeps its id from being reused by another object
_peers: dict[int, tuple[Any, PeerInfo]] = {}


def register(llm_args: Any, info: PeerInfo) -> None:
    with _lock:
        _peers[id(llm_args)] = (llm_args, info)


def unregister(llm_args: Any) -> None:
    with _lock:
        _peers.pop(id(llm_args), None)


def lookup(llm_args: Any) -> PeerInfo | None:
    """The worker registered with this very ``llm_args``, else the process's only worker."""
    with _lock:
        entry = _peers.get(id(llm_args))
        if entry is not None and entry[0] is llm_args:
            return entry[1]
        return next(iter(_peers.values()))[1] if len(_peers) == 1 else None
