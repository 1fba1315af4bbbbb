"""Logs each hold of the pool's eviction lock to a local file, one JSON line per event.

An ``acquired`` line is written just after a successful acquire and a ``releasing`` line just
before the release, so a logged interval lies inside the real one: two processes' logged
intervals that overlap prove two evictors at once.  ``busy`` marks an acquire that found the lock
held.  Run as a script (``evict_lock_log.py LOG``) it is the capacity guard's eviction process
with the same log installed, for the ``process`` runner, whose lock is taken in the child.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any


def install(lock_cls: Any, log_path: str) -> bool:
    """Wrap ``lock_cls.acquire`` and ``release`` to log to ``log_path``; False if the class lacks them."""
    if lock_cls is None or not hasattr(lock_cls, "acquire") or not hasattr(lock_cls, "release"):
        return False
    acquire, release = lock_cls.acquire, lock_cls.release
    fh = open(log_path, "a", buffering=1)

    def event(ev: str, lock: Any) -> None:
        fh.write(json.dumps({"ev": ev, "t": time.time_ns(), "pid": os.getpid(), "host": socket.gethostname(),
                             "path": lock.path, "id": id(lock)}) + "\n")

    def logged_acquire(self: Any) -> bool:
        ok = acquire(self)
        event("acquired" if ok else "busy", self)
        return ok

    def logged_release(self: Any) -> None:
        if getattr(self, "_fd", -1) >= 0 or getattr(self, "_token", ""):
            event("releasing", self)
        return release(self)

    lock_cls.acquire, lock_cls.release = logged_acquire, logged_release
    return True


def main() -> None:
    from gds_kv_connector.maintenance import evict_process, eviction

    install(eviction.EvictLock, sys.argv[1])
    status = evict_process.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # as the evictor's own entry point: its stdin reader thread may still hold a lock


if __name__ == "__main__":
    main()
