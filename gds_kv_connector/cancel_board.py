"""Cancelled loads told to the other TP ranks' workers without waiting for metadata.

Under plain TP only rank 0 has a scheduler, and every worker hears of a whole handed-over offer
cancelled (``cancel_load``) from the next metadata.  TensorRT-LLM builds metadata only in an
iteration that can queue work (contract 6b): with every request parked for its load none does,
while a cancelled request's deadline is now its control grace (about a second), so the other
ranks' loads would run on until the process fails.  The scheduler therefore also posts each such
request id to a small file that every worker on the node reads in ``get_finished`` while it has
asynchronous loads in flight; the metadata that hands loads over names the file.

The file: request ids as 8-byte little-endian integers, each post one ``O_APPEND`` write, never
rewritten.  It lives in /dev/shm (node-local memory; a worker on another node does not find it
and waits for the metadata, as before), named ``gdskv-cancels-<pid>-<random>``, and is removed
when the scheduler is collected or its process exits.
"""

from __future__ import annotations

import os
import struct
import tempfile
import weakref

_ID = struct.Struct("<q")


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class CancelBoard:
    """The scheduler's side: made on first use, posted to for each cancelled handed-over offer."""

    def __init__(self) -> None:
        self.path = os.path.join(_directory(), f"gdskv-cancels-{os.getpid()}-{os.urandom(6).hex()}")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._finalizer = weakref.finalize(self, _remove, self._fd, self.path)

    def post(self, request_ids: list[int]) -> None:
        os.write(self._fd, b"".join(_ID.pack(rid) for rid in request_ids))

    def close(self) -> None:
        self._finalizer()


def _remove(fd: int, path: str) -> None:
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class CancelReader:
    """A worker's side: the ids posted since its last read.  A board that cannot be opened (another
    node's, or removed) reads as empty: the cancels still come in the metadata."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY)
        except OSError:
            self._fd = None

    def new_ids(self) -> list[int]:
        if self._fd is None:
            return []
        data = os.pread(self._fd, 1 << 16, self._offset)
        whole = len(data) - len(data) % _ID.size  # a post is one write, but never read half an id
        self._offset += whole
        return [rid for (rid,) in _ID.iter_unpack(data[:whole])]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
