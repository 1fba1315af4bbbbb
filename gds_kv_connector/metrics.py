"""Owner counters for operators: a stats file per owner in the pool, and Prometheus text.

Owners on many nodes share one pool and no network endpoint, so each owner periodically drops
its counters into ``<root>/gdskv-v1/owners/<owner>.stats.json`` (replaced atomically, so a
reader never sees half a file) and ``gds-kv stats`` aggregates them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from .pool import _HOST
from .pool_scan import owners_dir

STATS_SUFFIX = ".stats.json"
METRIC_PREFIX = "gdskv_"
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_:]")


def stats_path(root: str, owner_id: str) -> str:
    return os.path.join(owners_dir(root), owner_id + STATS_SUFFIX)


def write_owner_stats(root: str, owner_id: str, counters: Mapping[str, int]) -> str:
    """Replace this owner's stats file; returns its path."""
    path = stats_path(root, owner_id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body = json.dumps({"owner": owner_id, "host": _HOST, "pid": os.getpid(), "updated_ns": time.time_ns(),
                       "counters": {str(k): int(v) for k, v in counters.items()}}, sort_keys=True)
    tmp = f"{path}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
    try:
        os.write(fd, body.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_owner_stats(root: str) -> dict[str, dict]:
    """Every owner's last stats, by owner id; unreadable or malformed files are skipped."""
    d = owners_dir(root)
    out: dict[str, dict] = {}
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(STATS_SUFFIX):
            continue
        try:
            with open(os.path.join(d, name), "rb") as fh:
                data = json.loads(fh.read(1 << 20))
        except (OSError, ValueError):
            continue
        counters = data.get("counters") if isinstance(data, dict) else None
        if not isinstance(counters, dict):
            continue
        data["counters"] = {str(k): v for k, v in counters.items() if isinstance(v, int)}
        out[name[:-len(STATS_SUFFIX)]] = data
    return out


def render_prometheus(counters: Mapping[str, int], labels: Mapping[str, str] | None = None) -> str:
    """Prometheus text exposition (0.0.4) of monotonic counters as ``gdskv_<name>_total``."""
    label_text = ""
    if labels:
        label_text = "{" + ",".join(f'{_metric_name(k)}="{_escape(str(v))}"'
                                    for k, v in sorted(labels.items())) + "}"
    lines = []
    for name in sorted(counters):
        metric = METRIC_PREFIX + _metric_name(name) + "_total"
        lines.append(f"# TYPE {metric} counter")
        lines.append(f"{metric}{label_text} {int(counters[name])}")
    return "\n".join(lines) + "\n" if lines else ""


class StatsPublisher:
    """Writes ``snapshot()`` to this owner's stats file in every root every ``interval_s``."""

    def __init__(self, roots: Sequence[str], owner_id: str, snapshot: Callable[[], Mapping[str, int]],
                 interval_s: float) -> None:
        self.roots, self.owner_id, self._snapshot = tuple(roots), owner_id, snapshot
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name="gdskv-stats",
                                            daemon=True)
            self._thread.start()

    def publish(self) -> None:
        counters = self._snapshot()
        for root in self.roots:
            try:
                write_owner_stats(root, self.owner_id, counters)
            except OSError:
                pass  # the next interval tries again; stats never fail serving

    def close(self) -> None:
        """Stop and write the final counters, which stay readable after this owner exits."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.publish()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.publish()


def _metric_name(name: str) -> str:
    cleaned = _NAME_BAD.sub("_", name)
    return "_" + cleaned if cleaned[:1].isdigit() else cleaned


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")
