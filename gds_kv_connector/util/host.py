"""This host as the pool's file names carry it, and whether a process of this host still runs.

Owner ids, lock holders, temporary files and slabs name the host that made them, so a process
tells its own host's leftovers (whose writers it can check) from other hosts' (which it must
leave to age)."""

from __future__ import annotations

import hashlib
import os
import socket

# pid_t is a C int: a larger number in a temporary file's name was not written by a process


_PID_MAX = 2**31 - 1

# This host in names split on "-" (owner ids, lock holders, temporary files).  Never cut short:
# hosts whose names differ only near the end (StatefulSet pods) would share it.


HOST = socket.gethostname().replace("-", "_") or "host"


_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.")


def host_tag(host: str | None = None) -> str:
    """A host's name as file names carry it where a process must tell its own host's files from
    other hosts': ``<readable>_<hash>``, the first 24 characters (each other than a letter, digit or
    ``.`` written ``_``, so no ``-`` and nothing a name rule rejects) and 8 hex digits of the SHA-256
    of the whole name, so the length is bounded and hosts that differ only further on (StatefulSet
    pods ``...-worker-0`` and ``-1``, long FQDNs) still differ."""
    host = HOST if host is None else host
    readable = "".join(c if c in _TAG_CHARS else "_" for c in host[:24]) or "host"
    if readable[0] == ".":  # a hidden name, which slab names may not be
        readable = "_" + readable[1:]
    return f"{readable}_{hashlib.sha256(host.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


HOST_TAG = host_tag()


def parse_pid(text: str) -> int | None:
    """A pid written by ``str(os.getpid())``: ASCII digits only (``str.isdigit`` also accepts
    '²' and other digits ``int`` rejects), no leading zero, within pid_t; else None."""
    if not 0 < len(text) <= 10 or not text.isascii() or not text.isdigit() or text[0] == "0":
        return None
    pid = int(text)
    return pid if pid <= _PID_MAX else None


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs in this pid namespace.  A number no process can have (not
    positive, or beyond pid_t, which os.kill cannot even pass: OverflowError) is not alive; an
    answer other than "no such process" counts as alive, the safe side for every caller."""
    if pid == os.getpid():
        return True
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True
