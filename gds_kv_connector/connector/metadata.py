"""What the scheduler tells the workers each iteration.

Under TP this object is pickled and broadcast every iteration, so it holds only plain tuples:
block ids and 32-byte keys, never tensors or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gds_kv_connector.transfer.jobs import LoadOp, SaveOp


@dataclass
class GdsKvMetadata:
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    # Requests reset (V2 ``request_reset``) since the last metadata, under plain TP: every rank's
    # worker fences their transfers in start_load_kv, before the forward that may reuse their pages.
    resets: list[int] = field(default_factory=list)
    # Requests whose whole offer, already handed to the workers, was cancelled (V2 ``cancel_load``)
    # since the last metadata, under plain TP: every rank's worker stops their loads in start_load_kv.
    cancels: list[int] = field(default_factory=list)
    # Under plain TP, with asynchronous loads: the file the scheduler also posts those cancels to
    # (cancel_board.py), which workers read while no metadata comes (every request parked)
    cancel_board: str = ""
    # Each metadata the scheduler builds has its own serial; one built again for the same scheduler
    # output (TensorRT-LLM rebuilds a bound plan after releasing an unstarted load) names the serial
    # it replaces, so a worker never starts a load or a save twice (``start_load_kv`` may also be
    # called again with the same binding).
    serial: int = 0
    replaces: int = 0

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.resets or self.cancels)
