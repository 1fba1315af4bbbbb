"""The one storage interface the transfer layer drives: save, pin and load batches of blocks.

A store runs on transfer threads.  Per-block failures are returned, not raised, so one bad file or
one full disk never takes down the batch of another request; the caller decides what a failure
means (a dropped save is counted, a failed promised load is fatal).

Two stores implement it (:func:`open_store` picks one by the pool): :class:`~.files.FileStore`
keeps one file per block; :class:`~.slots.SlotStore` keeps blocks in the slot arena's slabs and
falls back to block files when no slot is free, so a batch it loads may hold both kinds.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gds_kv_connector.engines.base import InTime, IoEngine, Once, ViewsRead, WriteExpired
from gds_kv_connector.format.records import FormatError
from gds_kv_connector.store.pool import FILE_FAULT_ERRNOS, BlockPool, Pin

if TYPE_CHECKING:
    import torch


@dataclass
class SaveOutcome:
    published: int = 0
    already_present: int = 0
    lost_race: int = 0
    failed: list[tuple[bytes, str]] = field(default_factory=list)  # (key, cause)
    bytes_written: int = 0
    arena_fallback: int = 0  # saved as block files because the arena had no free slot
    expired: int = 0  # not written: the save's deadline passed before their writes could start


class LoadFailure(RuntimeError):
    """A promised block could not be loaded; ``key``/``path``/``reason`` say which and why."""

    def __init__(self, key: bytes, path: str, reason: str) -> None:
        super().__init__(f"block {key.hex()} ({path}): {reason}")
        self.key, self.path, self.reason = key, path, reason
        self.request_id: int | None = None  # set by the transfer layer when the batch held several requests


class LoadStopped(Exception):
    """A load stopped between blocks by its ``in_time`` (no request of it will use the blocks): not a
    failure; ``blocks`` of it were not read, and its views hold no KV anyone may use."""

    def __init__(self, blocks: int) -> None:
        super().__init__(f"load stopped with {blocks} block(s) not read")
        self.blocks = blocks


class BlockStore(ABC):
    """Blocks of one pool moved by one engine."""

    def __init__(self, pool: BlockPool, engine: IoEngine | None = None) -> None:
        self.pool, self.engine = pool, engine

    def save(self, keys: list[bytes], parents: list[bytes], views: list[torch.Tensor],
             in_time: InTime | None = None, views_read: ViewsRead | None = None,
             on_staged: ViewsRead | None = None) -> SaveOutcome:
        """Publish each (key, view) not yet in the pool; ``parents[i]`` is the key of the block before.
        With ``in_time``, blocks whose write has not started once it returns False are left out
        (``expired``): a save stops between blocks at its deadline instead of holding its pages.
        ``views_read`` is called once no view will be read again: before the writes end where the
        engine stages the bytes (the last ``engine.write`` gets it), at the latest before this returns.
        ``on_staged`` is called after it only in the first case, when writes from the stage are left."""
        once = Once(views_read)
        early = once
        if on_staged is not None:
            def staged() -> None:
                once()
                on_staged()
            early = Once(staged)
        try:
            return self._save(keys, parents, views, in_time, early)
        finally:
            once()

    @abstractmethod
    def _save(self, keys: list[bytes], parents: list[bytes], views: list[torch.Tensor], in_time: InTime | None,
              views_read: Once) -> SaveOutcome:
        """:meth:`save` with its ``views_read`` made once-only."""

    def pin(self, keys: list[bytes]) -> list[Pin]:
        """Pin every key or none; raises LoadFailure for the first that cannot be opened."""
        pool = self.pool
        pins: list[Pin] = []
        try:
            try:
                pool.pin_all(keys, pins)
            except FileNotFoundError:
                key = keys[len(pins)]
                pool.forget(key)
                raise LoadFailure(key, pool.path_for(key), "file vanished before it could be opened") from None
            except (FormatError, EOFError) as exc:  # pool.pin has quarantined the file already
                key = keys[len(pins)]
                raise LoadFailure(key, pool.path_for(key), str(exc)) from None
            except OSError as exc:
                key = keys[len(pins)]
                moved = "; moved out of the pool (quarantined), so no owner meets it again" \
                    if exc.errno in FILE_FAULT_ERRNOS else ""
                raise LoadFailure(key, pool.path_for(key), f"open failed: {exc}{moved}") from None
        except BaseException:
            pool.unpin_all(pins)
            raise
        return pins

    def unpin(self, pins: list[Pin]) -> None:
        self.pool.unpin_all(pins)

    @abstractmethod
    def load(self, pins: list[Pin], views: list[torch.Tensor], *, verify: bool, retries: int, deadline: float,
             in_time: InTime | None = None) -> int:
        """Read pinned blocks into views and verify them; raises LoadFailure.  Returns bytes read.
        With ``in_time``, reads not started once it returns False are skipped and the load raises
        :class:`LoadStopped` (the blocks will not be used, so they are neither read nor checked)."""


def open_store(pool: BlockPool, engine: IoEngine | None = None) -> BlockStore:
    """The store of ``pool``: its slot arena where it runs one, else its block files.  ``engine``
    may be left out by a caller that only pins."""
    if pool.arena is not None:
        from gds_kv_connector.store.slots import SlotStore
        return SlotStore(pool, engine)
    from gds_kv_connector.store.files import FileStore
    return FileStore(pool, engine)


def count_failed(out: SaveOutcome, key: bytes, err: BaseException) -> None:
    """One block's write failure: expired (its deadline) or failed with its cause."""
    if isinstance(err, WriteExpired):
        out.expired += 1
    else:
        out.failed.append((key, cause(err)))


def cause(exc: BaseException) -> str:
    """A short, stable cause label for counting and once-per-cause logging."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__
