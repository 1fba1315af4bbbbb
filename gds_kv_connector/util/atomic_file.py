"""Files other processes rename and remove under us.  Replacing a small shared file whole (an
access-log archive or a compacted log, an owner's stats file): readers in other processes see the
old bytes or the new, never a half-written file, and a failed write leaves no temporary file
behind.  And telling whether a name still leads to the file one holds open (an access log a fold
renamed away, a slab gc removed between an adopter's open and its lock).

Temporary files name their writer: ``<path>.tmp-<host tag>-<pid>-<rand>`` here, and
``.tmp-<key>-<host tag>-<pid>-<rand>`` for the pool's blocks (:mod:`.pool`).  A pid alone does not
say that its writer is dead: from another pid namespace on a host of the same name (a sidecar,
``kubectl exec``, a hostNetwork pod) a live writer's pid looks unused, or names another process.
So a process that writes into a pool holds a *writer mark* in each root's owners directory for
its life, ``<host tag>-<pid>-<rand>.writer``, locked with ``flock`` (:class:`WriterMark`).  The
kernel drops the lock when the process dies, however it dies and whichever namespace looks, and
a mark is renamed into place only once locked.  A pid of this host whose marks are all unlocked
is a dead writer's (:func:`dead_writers`), and its temporary files can go at once instead of after
the age rules of :func:`~.pool.tmp_is_stale`.  A pid without a mark is never taken for dead: a
writer of an older version, or one on a filesystem without ``flock``, keeps the age rules.  What
remains: such an unmarked writer in another pid namespace of this host whose pid equals a dead
marked writer's loses its temporary files younger than the age rules (its publication fails and
is counted; nothing published is touched).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import threading
from collections.abc import Sequence

from gds_kv_connector.util.host import HOST_TAG, parse_pid

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
WRITER_SUFFIX = ".writer"
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


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


def tmp_path(path: str) -> str:
    """A new temporary name beside ``path``, naming this process as its writer."""
    return f"{path}{TMP_MARK}{HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}"


def tmp_writer(name: str) -> tuple[str, int] | None:
    """(host tag, pid) of the writer a temporary file's name gives, for :func:`tmp_path`'s names and
    the pool's; None for any other name (one made before host tags included: its host part may
    be another host's cut short)."""
    _, mark, tail = name.rpartition(TMP_MARK)
    parts = tail.split("-")
    if not mark or len(parts) < 3:
        return None
    pid = parse_pid(parts[-2])
    return None if pid is None else (parts[-3], pid)


def atomic_write(path: str, data: bytes, mode: int = 0o640) -> None:
    """Write ``data`` to a temporary name beside ``path`` and rename it over ``path``."""
    tmp = tmp_path(path)
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


def warn_once(path: str, message: str, *args: object) -> None:
    """Log ``message`` at warning level the first time this process says it of ``path``: a bad file
    in a shared directory is met again at every read, and one line says it."""
    with _WARNED_LOCK:
        if path in _WARNED:
            return
        _WARNED.add(path)
    log.warning(message, *args)


class WriterMark:
    """This process's writer mark in each of ``dirs`` (the owners directories of a pool's roots),
    held until :meth:`close`.  A directory where no mark can be made (no ``flock`` there, no
    permission) is left unmarked: this process's temporary files there keep the age rules."""

    def __init__(self, dirs: Sequence[str]) -> None:
        self.paths: list[str] = []
        self._fds: list[int] = []
        for d in dirs:
            held = _hold_mark(d)
            if held is not None:
                self.paths.append(held[0])
                self._fds.append(held[1])

    def close(self) -> None:
        """Remove the marks: unlinked before unlocked, so none is ever seen unlocked by a checker
        while this process lives."""
        for path, fd in zip(self.paths, self._fds):
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)
        self.paths, self._fds = [], []


def _hold_mark(d: str) -> tuple[str, int] | None:
    """(path, locked descriptor) of a new mark in ``d``, or None where none can be held.  It is
    created and locked under a temporary name and renamed into place, so a checker never finds it
    unlocked and takes a live writer for a dead one."""
    path = os.path.join(d, f"{HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}{WRITER_SUFFIX}")
    tmp = tmp_path(path)
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     os.stat(d).st_mode & 0o666)  # readable where the directory is: others check it
    except OSError as exc:
        return _unmarked(d, exc)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, path)
    except OSError as exc:  # ENOLCK, EOPNOTSUPP...: a filesystem without flock
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return _unmarked(d, exc)
    return path, fd


def _unmarked(d: str, exc: OSError) -> None:
    log.info("no writer mark in %s (%s): temporary files this process leaves there wait for their age "
             "to be removed", d, exc)
    return None


def dead_writers(d: str) -> dict[int, list[str]]:
    """This host's dead writers by the marks in ``d``: pid -> its marks, for each pid whose every
    mark is unlocked.  A mark that cannot be examined (another user's, a FIFO planted under its
    name, a filesystem without ``flock``) counts as held."""
    marks: dict[int, list[str]] = {}
    held: set[int] = set()
    try:
        names = os.listdir(d)
    except OSError:
        return {}
    for name in names:
        pid = _marked_pid(name)
        if pid is None:
            continue
        path = os.path.join(d, name)
        marks.setdefault(pid, []).append(path)
        if mark_held(path):
            held.add(pid)
    return {pid: paths for pid, paths in marks.items() if pid not in held}


def _marked_pid(name: str) -> int | None:
    """The pid a mark of this host names; None for anything else."""
    parts = name[:-len(WRITER_SUFFIX)].split("-") if name.endswith(WRITER_SUFFIX) else ()
    return parse_pid(parts[1]) if len(parts) == 3 and parts[0] == HOST_TAG else None


def mark_held(path: str) -> bool:
    """Whether a process holds the mark's lock (a gone mark is not held: its writer removed it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # dropped with the close below
        return False
    except OSError:  # EWOULDBLOCK: held; anything else: cannot tell, so held
        return True
    finally:
        os.close(fd)
