"""An eviction run in a process of its own, so that the serving process's executor thread never waits for it.

A run over a large pool is seconds to minutes of Python.  In the serving process it holds the GIL
the executor thread needs between its callbacks, and the executor's callback latency grows with
it (``profiling/executor_under_eviction.py`` measures both ways; docs/performance.md, "Executor
latency under maintenance").  :class:`~.capacity.CapacityGuard` therefore starts a fresh
interpreter for each run (``python -m gds_kv_connector.maintenance.evict_process``: exec'd at
once, never a Python-level fork of a process that holds CUDA state and threads) and waits on its
pipes in ``select``, which releases the GIL.  The child lowers its own CPU priority
(:data:`CHILD_NICE`): on a host with few free cores serving goes first.

Protocol, one JSON object per line:

* stdin, first line: the run (roots, budget, grace) and the serving owner's access records that
  are not in its logs yet (:meth:`~.recency.RecencyLog.unwritten`, per root, keys in hex).
* stdin, later lines: ``{"unwritten": [...]}``, records the owner queued since, sent while its log
  cannot be written.
* stdin at its end: the owner is gone, or gave up on the run; the child exits at once.  A run cut
  short anywhere leaves a sound pool (eviction only unlinks published files), and its locks die
  with it, so a child never outlives its owner.
* stdout: one line, ``{"reports": [...]}`` (:meth:`~.eviction.EvictionReport.to_dict`, in roots' order).
* stderr: the child's warnings, on the owner's stderr.

Rules, and why:

* The child runs :func:`~.eviction.evict_pool`, which takes every root's :class:`~.eviction.EvictLock`:
  still one evictor per root across the pool, whoever runs it.
* Promised blocks are never removed.  The owner flushes its access log just before starting the
  child, so the child reads this owner's promises from the logs as it reads any owner's, again
  while it unlinks (:data:`~.eviction.RECHECK_S`).  What could not be written (a full disk, which
  is when eviction runs) goes in the first line, and what the owner queues while its log keeps
  failing follows every :data:`UNWRITTEN_SEND_S`; the child adds both to its indexes, as the
  in-process evictor does with :meth:`~.recency.RecencyLog.unwritten`.  While the log is written,
  this owner's promise made during the run has the gap of every other owner's (docs in
  :mod:`.eviction`): the flusher writes a promise at once, and the child reads it at its next recheck.
* A child that cannot start, crashes, writes no reports or is still running after the time limit
  (then killed) raises :class:`EvictChildFailed` in the owner, which never waits longer than the limit.
* A child keeps nothing between runs: no header cache (it reads every published file's header
  again each run, its I/O and its CPU, not the executor's) and no incremental access-log index
  (it reads each log whole, at most :data:`~.recency.MAX_READ_BYTES` of it).
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import fields
from functools import partial
from typing import IO

from gds_kv_connector.maintenance.eviction import EvictionReport, evict_pool
from gds_kv_connector.maintenance.recency import RecencyIndex, RecencyLog

log = logging.getLogger(__name__)

MODULE = "gds_kv_connector.maintenance.evict_process"
CHILD_NICE = 10  # added to the child's niceness: a run may take longer, serving may not
TICK_S = 0.1  # how often the owner, waiting on the pipes, looks at its limit, its stop and its log
UNWRITTEN_SEND_S = 0.1  # how often queued records go to the child while the owner's log fails
KILL_WAIT_S = 5.0  # after SIGKILL, for the kernel to reap the child
MAX_REPORT_BYTES = 16 << 20  # of the child's stdout: far above one report per root
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class EvictChildFailed(RuntimeError):
    """The child gave no reports: it could not start, exited without them, or ran past its limit."""


def child_argv() -> list[str]:
    """The command of a child run: this interpreter, started afresh."""
    return [sys.executable, "-m", MODULE]


def evict_in_child(roots: Sequence[str], quota_bytes: int, low_watermark: float, min_free_bytes: int,
                   grace_s: float, *, time_limit_s: float, recency: RecencyLog | None = None,
                   argv: Sequence[str] | None = None, cancel: threading.Event | None = None) -> list[EvictionReport]:
    """:func:`~.eviction.evict_pool` in a child process; the caller's thread waits without the GIL.

    ``recency``: the owner's access log, already flushed; its unwritten records go to the child.
    ``argv``: the child's command (default :func:`child_argv`; a wrapper such as ``nice`` or
    ``ionice`` may go in front).  ``cancel`` set, or ``time_limit_s`` passed, kills the child.
    Raises :class:`EvictChildFailed` for any run that gave no reports.
    """
    queued = [recency.unwritten(i) for i in range(len(roots))] if recency is not None else [{} for _ in roots]
    request = {"roots": [os.path.abspath(r) for r in roots], "quota_bytes": quota_bytes,
               "low_watermark": low_watermark, "min_free_bytes": min_free_bytes, "grace_s": grace_s,
               "unwritten": [_hex(q) for q in queued]}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen(list(argv or child_argv()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=env, close_fds=True)
    except OSError as exc:
        raise EvictChildFailed(f"cannot start the eviction process: {exc}") from exc
    try:
        out = _talk(proc, _line(request), queued, time.monotonic() + time_limit_s, recency, cancel)
        rc = proc.wait(KILL_WAIT_S)  # its stdout is closed: it is exiting
    except EvictChildFailed:
        _kill(proc)
        raise
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise EvictChildFailed("the eviction process closed its output and did not exit; killed") from None
    finally:
        for pipe in (proc.stdin, proc.stdout):
            _close_quiet(pipe)
    if rc != 0:
        raise EvictChildFailed(f"the eviction process exited with status {rc}")
    try:
        return [_report(d) for d in json.loads(out)["reports"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise EvictChildFailed(f"the eviction process wrote no readable reports: {exc}") from None


def _talk(proc: subprocess.Popen, first: bytes, sent: list[dict[bytes, int]], deadline: float,
          recency: RecencyLog | None, cancel: threading.Event | None) -> bytes:
    """Write the request (and queued records as the owner's log keeps failing) and read stdout to its
    end, never blocking on either pipe for longer than :data:`TICK_S`."""
    assert proc.stdin is not None and proc.stdout is not None
    wfd, rfd = proc.stdin.fileno(), proc.stdout.fileno()
    os.set_blocking(wfd, False)  # a child that stopped reading must not block the owner's writes
    pending, out, next_send = bytearray(first), bytearray(), time.monotonic() + UNWRITTEN_SEND_S
    while True:
        now = time.monotonic()
        if now >= deadline:
            raise EvictChildFailed("the eviction process was still running at its time limit; killed")
        if cancel is not None and cancel.is_set():
            raise EvictChildFailed("the eviction run was cancelled; its process killed")
        if recency is not None and now >= next_send and wfd >= 0:
            next_send = now + UNWRITTEN_SEND_S
            if recency.failing:
                pending += _news(recency, sent)
        readable, writable, _ = select.select([rfd], [wfd] if pending and wfd >= 0 else [], [],
                                              min(TICK_S, max(0.0, deadline - now)))
        if writable:
            try:
                del pending[:os.write(wfd, pending)]
            except BlockingIOError:
                pass
            except OSError:  # the child closed its stdin or died: what it says on stdout decides
                pending.clear()
                wfd = -1
        if readable:
            chunk = os.read(rfd, 1 << 16)
            if not chunk:
                return bytes(out)
            out += chunk
            if len(out) > MAX_REPORT_BYTES:
                raise EvictChildFailed(f"the eviction process wrote over {MAX_REPORT_BYTES} bytes; killed")


def _news(recency: RecencyLog, sent: list[dict[bytes, int]]) -> bytes:
    """The owner's unwritten records newer than those sent, as one line (empty if none)."""
    new: list[dict[bytes, int]] = []
    for i, known in enumerate(sent):
        fresh = {k: t for k, t in recency.unwritten(i).items() if known.get(k, 0) < t}
        known.update(fresh)
        new.append(fresh)
    return _line({"unwritten": [_hex(d) for d in new]}) if any(new) else b""


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # unkillable for now (D state): the kernel reaps it later
        log.warning("gds-kv: eviction process %d not reaped %.0f s after SIGKILL", proc.pid, KILL_WAIT_S)


def _close_quiet(pipe: IO[bytes] | None) -> None:
    try:
        if pipe is not None:
            pipe.close()
    except OSError:
        pass


def _line(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _hex(records: dict[bytes, int]) -> dict[str, int]:
    return {k.hex(): t for k, t in records.items()}


_REPORT_FIELDS = {f.name for f in fields(EvictionReport)}


def _report(d: dict) -> EvictionReport:
    return EvictionReport(**{k: v for k, v in d.items() if k in _REPORT_FIELDS})


class _Queued:
    """The owner's unwritten records, per root, as they arrive on stdin."""

    def __init__(self, n_roots: int) -> None:
        self._by_root: list[dict[bytes, int]] = [{} for _ in range(n_roots)]
        self._lock = threading.Lock()

    def merge(self, by_root: list[dict[str, int]]) -> None:
        if len(by_root) != len(self._by_root):
            raise ValueError(f"unwritten records for {len(by_root)} root(s), not {len(self._by_root)}")
        with self._lock:
            for into, records in zip(self._by_root, by_root):
                for key, ts in records.items():
                    k = bytes.fromhex(key)
                    if into.get(k, 0) < ts:
                        into[k] = int(ts)

    def of(self, root: int) -> dict[bytes, int]:
        with self._lock:
            return dict(self._by_root[root])


def _follow(stdin: IO[bytes], queued: _Queued) -> None:
    """Take further records from the owner until its end of the pipe closes, then end the run."""
    for line in stdin:
        try:
            queued.merge(json.loads(line)["unwritten"])
        except (ValueError, KeyError, TypeError) as exc:
            print(f"gds-kv evictor: bad line from the owner ({exc}); run abandoned", file=sys.stderr, flush=True)
            os._exit(2)
    os._exit(1)  # the owner is gone or gave up: no run goes on without the owner that promised


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="gds-kv evictor: %(levelname)s %(message)s")
    try:
        os.nice(CHILD_NICE)
    except OSError:
        pass
    stdin = sys.stdin.buffer
    try:
        req = json.loads(stdin.readline())
        roots = [str(r) for r in req["roots"]]
        queued = _Queued(len(roots))
        queued.merge(req["unwritten"])
        budget = (int(req["quota_bytes"]), float(req["low_watermark"]), int(req["min_free_bytes"]),
                  float(req["grace_s"]))
    except (ValueError, KeyError, TypeError) as exc:
        print(f"gds-kv evictor: bad request from the owner: {exc}", file=sys.stderr)
        return 2
    threading.Thread(target=_follow, args=(stdin, queued), name="gdskv-evict-owner", daemon=True).start()
    indexes = [RecencyIndex(r, partial(queued.of, i)) for i, r in enumerate(roots)]
    reports = evict_pool(roots, *budget, recency=indexes)
    sys.stdout.write(_line({"reports": [r.to_dict() for r in reports]}).decode())
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # not sys.exit: finalizing would wait for the reader thread's lock on stdin
