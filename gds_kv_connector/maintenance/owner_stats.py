"""Owner counters for operators: a stats file per owner process in the pool.

Owners on many nodes share one pool and no network endpoint, so each owner periodically drops
its numbers into ``<root>/gdskv-v1/owners/<owner>.<started_ns>.stats.json`` (replaced
atomically, so a reader never sees half a file) and ``gds-kv stats`` aggregates them.

Two kinds of number, kept apart in the file because they add up differently:

* ``counters`` only grow during a process's life (blocks saved, bytes loaded).  A total over
  the pool sums them over every file, including the final file a process leaves when it exits:
  what it did still happened.  That is why a file is named per process start, not by the owner
  id alone: a restarted container often gets the same host name and pid, and overwriting the
  previous process's final counters would make totals go backwards.
* ``gauges`` say what a process holds now (arena slots owned and used).  They are summed only
  over live owners (no ``final`` file, updated within a few publish intervals): a slab adopted
  by the next process would otherwise be counted once for each.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gds_kv_connector.util.atomic_file import atomic_write, warn_once
from gds_kv_connector.util.host import HOST
from gds_kv_connector.maintenance.pool_scan import open_regular, owners_dir
from gds_kv_connector.config.settings import MAX_SECONDS, SPECS

STATS_SUFFIX = ".stats.json"
MAX_STATS_FILE_BYTES = 1 << 20  # a bigger file is not one an owner wrote
MAX_VALUE = 2**63  # counters, gauges and times fit in 64 bits; a bigger one is garbage
MAX_NAME_LEN = 200
# for files that do not say their interval: TLLM_GDS_KV_STATS_INTERVAL_S's default
DEFAULT_INTERVAL_S = next(spec.default for spec in SPECS if spec.name == "stats_interval_s")
LIVE_INTERVALS = 3  # an owner not heard from for this many intervals is taken for gone


class Snapshot(dict):
    """One owner's numbers by name, counters and gauges in one mapping (how callers read a value),
    remembering which are gauges so the stats file can keep the two apart."""

    def __init__(self, counters: Mapping[str, int], gauges: Mapping[str, int] | None = None) -> None:
        super().__init__(counters)
        self.update(gauges or {})
        self.gauge_names = frozenset(gauges or ())

    @property
    def counters(self) -> dict[str, int]:
        return {k: v for k, v in self.items() if k not in self.gauge_names}

    @property
    def gauges(self) -> dict[str, int]:
        return {k: v for k, v in self.items() if k in self.gauge_names}


def stats_path(root: str, owner_id: str, started_ns: int) -> str:
    """The stats file of the process ``owner_id`` that started at ``started_ns``."""
    return os.path.join(owners_dir(root), f"{owner_id}.{started_ns}{STATS_SUFFIX}")


def write_owner_stats(root: str, owner_id: str, counters: Mapping[str, int], *,
                      gauges: Mapping[str, int] | None = None, started_ns: int, interval_s: float = 0.0,
                      final: bool = False) -> str:
    """Replace this process's stats file; returns its path."""
    path = stats_path(root, owner_id, started_ns)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body = json.dumps({"owner": owner_id, "host": HOST, "pid": os.getpid(), "started_ns": started_ns,
                       "updated_ns": time.time_ns(), "interval_s": interval_s, "final": final,
                       "counters": {str(k): int(v) for k, v in counters.items()},
                       "gauges": {str(k): int(v) for k, v in (gauges or {}).items()}}, sort_keys=True)
    atomic_write(path, body.encode())  # a short write no longer replaces good stats with half a file
    return path


def read_owner_stats(root: str) -> dict[str, dict[str, Any]]:
    """Every owner process's last stats, by file name (less the suffix).

    Files that are not regular, unreadable or not a JSON object with ``counters`` are skipped.
    Other fields are checked, since any owner (or anyone) can write there: a value of the wrong
    type or out of range is dropped and its field named in ``invalid``.  Files of versions
    before gauges and per-start names read as counters only, never final.
    """
    d = owners_dir(root)
    out: dict[str, dict[str, Any]] = {}
    try:
        names = os.listdir(d)
    except OSError:  # gone, or unreadable to this user (gds-kv stats counts it as unreadable)
        return out
    for name in names:
        stem = name[:-len(STATS_SUFFIX)]
        if not name.endswith(STATS_SUFFIX) or not good_name(stem):
            continue
        data = load_json(os.path.join(d, name))
        if isinstance(data, dict) and isinstance(data.get("counters"), dict):
            out[stem] = _checked(data, stem)
    return out


def live(entry: Mapping[str, Any], now_ns: int) -> bool:
    """Whether the owner of a :func:`read_owner_stats` entry is taken for running now: it has
    not written its final file, and it published within :data:`LIVE_INTERVALS` intervals."""
    updated = entry.get("updated_ns")
    if entry.get("final") or updated is None:
        return False
    interval = entry.get("interval_s") or DEFAULT_INTERVAL_S
    return now_ns - updated <= LIVE_INTERVALS * interval * 1e9


def load_json(path: str) -> Any:
    """A stats file's JSON (a regular file under the size bound), or None when it cannot be read:
    shared with the retired-owners archive, which reads and checks the same way.  One byte past the
    bound is read at most, and a file that has it is skipped and logged once."""
    try:
        fd, _ = open_regular(path)
    except OSError:
        return None
    try:
        raw = os.read(fd, MAX_STATS_FILE_BYTES + 1)
        if len(raw) > MAX_STATS_FILE_BYTES:
            warn_once(path, "%s is over %d bytes, not a file an owner wrote: skipped", path, MAX_STATS_FILE_BYTES)
            return None
        return json.loads(raw)
    except (OSError, ValueError, RecursionError):  # RecursionError: a file of nested brackets
        return None
    finally:
        os.close(fd)


def _checked(data: dict[str, Any], stem: str) -> dict[str, Any]:
    """The fields of one stats file that pass their checks, and the names of those that do not."""
    invalid: list[str] = []

    def field(name: str, ok: Callable[[Any], bool], default: Any = None) -> Any:
        value = data.get(name, default)
        if value is default or ok(value):
            return value
        invalid.append(name)
        return default

    def numbers(name: str) -> dict[str, int]:
        raw = data.get(name)
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            invalid.append(name)
            return {}
        good = {k: v for k, v in raw.items() if good_name(k) and good_int(v)}
        invalid.extend(f"{name}.{k}" if good_name(k) else f"{name}.?" for k in raw if k not in good)
        return good

    entry = {"owner": field("owner", good_name, stem), "host": field("host", good_name),
             "pid": field("pid", lambda v: good_int(v) and 0 < v < 2**31),
             "started_ns": field("started_ns", good_int), "updated_ns": field("updated_ns", good_int),
             "interval_s": field("interval_s", _good_interval), "final": field("final", _is_bool, False),
             "counters": numbers("counters"), "gauges": numbers("gauges")}
    entry["invalid"] = sorted(set(invalid))
    return entry


def good_int(v: Any) -> bool:
    """A counter as stats files hold it: a non-negative int under the bound (not a bool)."""
    return type(v) is int and 0 <= v < MAX_VALUE


def _good_interval(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0 <= v <= MAX_SECONDS


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def good_name(v: Any) -> bool:
    """Names end up in text output: printable (no line breaks, no undecodable bytes) and short."""
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME_LEN and v.isprintable()


class StatsPublisher:
    """Writes ``snapshot()`` to this process's stats file in every root every ``interval_s``, and
    a final one marked ``final`` at :meth:`close`.

    ``snapshot`` returns a :class:`Snapshot` (counters and gauges) or any mapping of counters.
    The file is named by ``owner_id`` and this publisher's start time, unique per process start.
    """

    def __init__(self, roots: Sequence[str], owner_id: str, snapshot: Callable[[], Mapping[str, int]],
                 interval_s: float) -> None:
        self.roots, self.owner_id, self._snapshot = tuple(roots), owner_id, snapshot
        self.interval_s = interval_s
        self.started_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name="gdskv-stats",
                                            daemon=True)
            self._thread.start()

    def paths(self) -> list[str]:
        return [stats_path(root, self.owner_id, self.started_ns) for root in self.roots]

    def publish(self, final: bool = False) -> None:
        snap = self._snapshot()
        counters, gauges = (snap.counters, snap.gauges) if isinstance(snap, Snapshot) else (snap, {})
        for root in self.roots:
            try:
                write_owner_stats(root, self.owner_id, counters, gauges=gauges, started_ns=self.started_ns,
                                  interval_s=self.interval_s, final=final)
            except OSError:
                pass  # the next interval tries again; stats never fail serving

    def close(self) -> None:
        """Stop and write the final counters, marked final: they stay readable after this owner
        exits, and its gauges stop counting at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.publish(final=True)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.publish()
