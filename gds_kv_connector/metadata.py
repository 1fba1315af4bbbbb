"""What the scheduler tells the workers each iteration.

Under TP this object is pickled and broadcast every iteration, so it holds only plain tuples:
block ids and 32-byte keys, never tensors or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


# Named tuples, not frozen dataclasses: the scheduler makes one per request in an admission
# iteration, and a named tuple is made in about half the time and pickles in about 60% of the bytes.
class LoadOp(NamedTuple):
    request_id: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    is_async: bool


class SaveOp(NamedTuple):
    request_id: int
    keys: tuple[bytes, ...]
    parents: tuple[bytes, ...]
    block_ids: tuple[int, ...]


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

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.resets or self.cancels)
