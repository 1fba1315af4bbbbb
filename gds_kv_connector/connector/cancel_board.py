"""Cancelled loads told to the other TP ranks' workers without waiting for metadata.

Under plain TP only rank 0 has a scheduler, and every worker hears of a whole handed-over offer
cancelled (``cancel_load``) from the next metadata.  TensorRT-LLM builds metadata only in an
iteration that can queue work (contract 6b): with every request parked for its load none does,
while a cancelled request's deadline is now TensorRT-LLM's control grace (``control_grace_sec``), so the other
ranks' loads would run on until the process fails.  The scheduler therefore also posts each such
request id to a small file that every worker on the node reads in ``get_finished`` while it has
asynchronous loads in flight, and in ``start_load_kv`` before it submits new ones (an id posted
while a rank had nothing in flight must not stop a later load of the same id, a replay after
``request_reset``); the metadata that hands loads over names the file.

The file: request ids as 8-byte little-endian integers, each post one ``O_APPEND`` write, never
rewritten.  It lives in /dev/shm (node-local memory; a worker on another node does not find it
and waits for the metadata, as before), named ``gdskv-cancels-<host>-<pid>-<random>``, and is
removed when the scheduler is collected or its process exits; a board of this host whose process
is gone (killed) is removed by the next one made.  The board only hastens what the metadata also
carries, so a board that cannot be made or written is logged once and left out, never an error.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import tempfile
import weakref

log = logging.getLogger(__name__)

_ID = struct.Struct("<q")
_PREFIX = "gdskv-cancels-"


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class CancelBoard:
    """The scheduler's side: made on first use (:meth:`open`), posted to for each cancelled
    handed-over offer."""

    def __init__(self, directory: str) -> None:
        host = socket.gethostname().replace("-", "_")
        _sweep(directory, host)
        self.path = os.path.join(directory, f"{_PREFIX}{host}-{os.getpid()}-{os.urandom(6).hex()}")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._finalizer = weakref.finalize(self, _remove, self._fd, self.path)
        self._failed = False

    @classmethod
    def open(cls, directory: str | None = None) -> CancelBoard | None:
        """A new board, or None where none can be made (the cancels then ride in the metadata alone)."""
        try:
            return cls(directory or _directory())
        except OSError as exc:
            log.warning("gds-kv-connector: no cancel board (%s); under plain TP a cancelled load reaches the "
                        "other ranks only with the next metadata", exc)
            return None

    def post(self, request_ids: list[int]) -> None:
        try:
            os.write(self._fd, b"".join(_ID.pack(rid) for rid in request_ids))
        except OSError as exc:  # /dev/shm full, say: the metadata still carries the ids
            if not self._failed:
                self._failed = True
                log.warning("gds-kv-connector: cancel board %s not written (%s); cancels reach the other ranks "
                            "with the next metadata", self.path, exc)

    def close(self) -> None:
        self._finalizer()


def _remove(fd: int, path: str) -> None:
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _sweep(directory: str, host: str) -> None:
    """Remove this host's boards whose process is gone (a killed scheduler's)."""
    mine = f"{_PREFIX}{host}-"
    try:
        names = [n for n in os.listdir(directory) if n.startswith(mine)]
    except OSError:
        return
    for name in names:
        pid = name[len(mine):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
        except OSError:  # alive, another user's
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
