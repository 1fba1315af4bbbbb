"""The engine interface the pool layer drives.

An engine moves whole block payloads between contiguous byte views of the KV pool and open
file descriptors, many at once, and computes payload checksums where the bytes live (CPU for a
host pool, GPU for a device pool).  Calls block the calling transfer thread, never the executor.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class TransferItem:
    """One payload transfer: ``view`` (uint8, contiguous) <-> ``fd`` at ``offset``.

    With ``header``, the ``len(header)`` bytes right before the payload travel too: written from
    it, or read into it (a bytearray), in the same I/O where the engine can.  A block file's
    header (offset 0) or an arena slot's (in a slab, ``offset - len(header)``) and its payload
    then cost one read or write instead of two, which is what small blocks on a disk pool pay for.
    """

    fd: int
    offset: int
    view: torch.Tensor
    header: bytes | bytearray | None = None


#: ``IoEngine.write``'s and ``read``'s ``in_time``: called before each I/O starts; False once the
#: batch was stopped (a save's deadline, a fence, a load whose request will not use it)
InTime = Callable[[], bool]
#: ``IoEngine.write``'s ``views_read``: called once no item's view will be read again
ViewsRead = Callable[[], None]


class Once:
    """A callback run at most once, by whichever of several paths gets there first (the copy that
    reads the last view, or the exit of a call that never reached it)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class TransferStopped(Exception):
    """An item not moved because its batch was stopped before its I/O could start."""


class WriteExpired(TransferStopped):
    """An item not written because its batch's deadline passed (or a fence stopped it) before its I/O
    could start: a save on storage slower than its deadline stops between blocks instead of holding
    its request's pages."""


class ReadStopped(TransferStopped):
    """An item not read because its load was stopped before its I/O could start: the request will not
    use those tokens (``cancel_load`` of the whole offer, or a reset), and TensorRT-LLM waits for the
    load to end before it frees the pages, for at most its control grace after a cancel."""


def expired_check(in_time: InTime | None, reading: bool = False) -> None:
    """Raise :class:`WriteExpired` (:class:`ReadStopped` when ``reading``) where ``in_time`` says no."""
    if in_time is not None and not in_time():
        if reading:
            raise ReadStopped("the load was stopped before this block's read started")
        raise WriteExpired("the save's deadline passed before this block's write started")


# How often a batch waiting for its queued I/O asks whether it was stopped (a save's deadline, a fence,
# a cancelled load)
STOP_POLL_S = 0.05


def run_all(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], jobs: list[Any],
            in_time: InTime | None = None, reading: bool = False) -> list[Any]:
    """``fn(job)`` for every job on ``pool`` (a batch of one job runs on the caller), results in order.

    With ``in_time``, jobs still queued in the pool once it returns False are cancelled, their
    result a :class:`WriteExpired` (:class:`ReadStopped` when ``reading``): the pool is shared with
    other batches, whose I/O queued ahead may be stuck, and a stopped batch must not wait for it.
    ``fn`` reports errors as its result and checks ``in_time`` itself before it starts."""
    if len(jobs) <= 1:
        return [fn(job) for job in jobs]
    futures = [pool.submit(fn, job) for job in jobs]
    if in_time is not None:
        pending = set(futures)
        while pending:
            pending = wait(pending, timeout=STOP_POLL_S).not_done
            if pending and not in_time():
                for future in pending:
                    future.cancel()
                break
    stopped = ReadStopped if reading else WriteExpired
    return [stopped("the transfer was stopped while this I/O waited for a thread") if f.cancelled()
            else f.result() for f in futures]


def header_io(item: TransferItem, write: bool, pwrite, preadv) -> None:
    """Move ``item.header`` on its own, for engines that cannot join it to the payload's I/O."""
    if item.header is None:
        return
    start = item.offset - len(item.header)
    if start < 0:
        raise ValueError(f"a header of {len(item.header)} bytes does not fit before payload offset {item.offset}")
    buf = memoryview(item.header)
    done = 0
    while done < len(buf):
        n = pwrite(item.fd, buf[done:], start + done) if write else preadv(item.fd, buf[done:], start + done)
        if n <= 0:
            if write:
                raise OSError(errno.EIO, f"pwrite wrote {n} bytes at offset {start + done}")
            raise EOFError(f"file ended after {start + done} bytes, inside a header")
        done += n


class IoEngine(ABC):
    #: short engine name ("posix", "kvikio")
    name: str = "?"

    @abstractmethod
    def write(self, items: list[TransferItem], in_time: InTime | None = None,
              views_read: ViewsRead | None = None) -> list[BaseException | None]:
        """Write every item; the result holds the error of each item, or None.  With ``in_time``,
        items whose I/O has not started once it returns False are not written (:class:`WriteExpired`).
        An engine that stages the bytes calls ``views_read`` once no item's view will be read again,
        before its writes end, so the pages behind the views can go back to their owner while the
        storage is still busy; one whose writes read the views to the end does not call it (the
        caller's own end, once the blocks are published, is then the first moment)."""

    @abstractmethod
    def read(self, items: list[TransferItem], in_time: InTime | None = None) -> list[BaseException | None]:
        """Read every item fully; a short file is an error of that item.  With ``in_time``, items whose
        I/O has not started once it returns False are not read (:class:`ReadStopped`)."""

    @abstractmethod
    def checksums(self, views: list[torch.Tensor], load: bool = False) -> list[int]:
        """Payload checksums (checksum.py's definition) of the given views; ``load`` says they
        verify a load, so engines that compute them on I/O threads run them beside the reads."""

    @abstractmethod
    def data_path(self) -> str:
        """Which path moves the bytes: posix, kvikio-posix, cufile-compat or gds, with the reason."""

    # -- mapped host memory (arena slabs of a host-memory pool, see arena.py) ---------------------
    def register_host(self, addr: int, nbytes: int, read_only: bool) -> None:
        """Make a mapped range a DMA target for the life of the mapping; no-op for host pools."""

    def unregister_host(self, addr: int) -> None:
        """Undo :meth:`register_host` before the range is unmapped."""

    @abstractmethod
    def copy_to_host(self, pairs: list[tuple[int, torch.Tensor]], pitch: int) -> None:
        """Copy each view to the host address paired with it; returns when the bytes are there.
        Host addresses ``pitch`` apart (consecutive slots) may be moved as one strided copy."""

    @abstractmethod
    def copy_from_host(self, pairs: list[tuple[int, torch.Tensor]], pitch: int) -> None:
        """Copy from each host address into the view paired with it; returns when they are there."""

    def close(self) -> None:
        """Release threads and handles; outstanding calls must have returned."""
