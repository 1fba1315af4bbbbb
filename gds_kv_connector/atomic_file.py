"""Files other processes rename and remove under us.  Replacing a small shared file whole (an
access-log archive or a compacted log, an owner's stats file): readers in other processes see the
old bytes or the new, never a half-written file, and a failed write leaves no temporary file
behind.  And telling whether a name still leads to the file one holds open (an access log a fold
renamed away, a slab gc removed between an adopter's open and its lock)."""

from __future__ import annotations

import errno
import os
import secrets

from .pool import _HOST


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``: a short write (a nearly full disk, a signal) is carried
    on, never taken for the whole."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite made no progress")
        done += n


def still_named(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open at ``fd``."""
    try:
        mine = os.fstat(fd)
        named = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return mine.st_nlink > 0 and (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)


def atomic_write(path: str, data: bytes, mode: int = 0o640) -> None:
    """Write ``data`` to a temporary name beside ``path`` and rename it over ``path``."""
    tmp = f"{path}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            pwrite_all(fd, data, 0)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
