"""Prometheus metrics of a pool, read from its owners' stats files (``gds-kv metrics``).

Owners publish no endpoint of their own: TensorRT-LLM runs one owner per MPI rank (several per node,
one per attention-DP rank), each would need a port of its own that the scrape configuration follows
through restarts, and an owner's numbers would end with its process.  Every owner already writes its
counters, gauges and latency histograms into the pool (:mod:`.owner_stats`), so one exporter per pool
turns those files into metrics when Prometheus scrapes it: each scrape lists the owners directory
and reads each stats file once, bounded (regular files only, at most 1 MiB each), and never scans
the blocks.

Two sets of series, named apart because they add up differently:

* ``gdskv_owner_*{owner, host}``: each live owner process (not final, heard from within a few
  publish intervals), its counters, gauges and histograms.  An owner id is host and pid; a process
  that restarted under the same id (a container's) replaces the earlier one, whose counters restart
  from 0 as Prometheus's ``rate`` expects.
* ``gdskv_*`` without those labels: the pool, as ``gds-kv stats`` sums it: counters and histograms
  over every process that published (exited ones and those whose files gc retired included, so
  they never go backwards), gauges over live owners; the pool's usage and quota as the most any live
  owner's evictor saw.

Counters named ``<x>_us`` or ``<x>_ms`` become ``<x>_seconds``; ``save_blocks_dropped_<cause>``,
``save_failed_<cause>`` and ``load_blocks_<cause>`` become one family each with a ``cause`` label.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gds_kv_connector.maintenance.owner_stats import live, read_owner_stats
from gds_kv_connector.maintenance.retired_owners import read_retired
from gds_kv_connector.util.counters import LATENCY_BOUNDS_US, Histogram, split_histograms

PREFIX = "gdskv_"
OWNER_PREFIX = PREFIX + "owner_"
OWNER_LABELS = ("owner", "host")
# Counters exported at 0 until they first grow: ``rate`` needs a sample before the first increase,
# and a panel of failures reads 0, not "no data", where there were none.  A save's failure is
# counted under the write's errno: those storage gives (full, over a quota, failing, read-only,
# refused, a server's stale handle) start at 0 too; another cause's series starts at its first
# failure, which a rate then misses.
ZERO_COUNTERS = ("match_queries", "match_blocks_hit", "match_blocks_miss", "tokens_loaded", "tokens_saved",
                 "bytes_loaded", "bytes_saved", "blocks_saved", "loads_sync", "loads_async", "load_failures",
                 "sync_load_wait_us", "evict_runs", "evict_blocks", "evict_bytes", "evict_child_failed",
                 "save_blocks_dropped_backlog",
                 "save_blocks_dropped_deadline", "save_blocks_dropped_at_finish", "save_blocks_dropped_at_shutdown",
                 "load_blocks_cancelled", "load_blocks_not_admitted",
                 *(f"save_failed_{e}" for e in ("ENOSPC", "EDQUOT", "EIO", "EROFS", "EACCES", "ESTALE")))
ZERO_HISTOGRAMS = ("load_latency_us", "save_latency_us")
# Counter families split by cause: (counter name prefix, family)
CAUSES = (("save_blocks_dropped_", "save_blocks_dropped"), ("save_failed_", "save_failed"),
          ("load_blocks_", "load_blocks_dropped"))
UNITS = (("_us", "_seconds", 1e6), ("_ms", "_seconds", 1e3))  # (suffix, unit, units per second)
# Gauges every owner sees the same of (one pool), so the pool's is the largest, not a sum
POOL_GAUGES = ("pool_usage_bytes", "pool_quota_bytes")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,99}")
DOCS = {
    "match_queries": "prefix lookups by the scheduler",
    "match_blocks_hit": "prompt blocks found in the pool (hit rate: hit / (hit + miss))",
    "match_blocks_miss": "prompt blocks looked up and not found",
    "tokens_loaded": "tokens whose KV was loaded from the pool",
    "tokens_saved": "tokens whose KV was published to the pool",
    "bytes_loaded": "KV bytes loaded from the pool",
    "bytes_saved": "KV bytes written to the pool",
    "sync_load_wait_seconds": "time forwards waited for synchronous loads",
    "save_blocks_dropped": "blocks not saved, by cause",
    "save_failed": "blocks whose save failed, by cause",
    "load_blocks_dropped": "matched blocks not loaded, by cause",
    "load_failures": "requests whose load failed (the process fails with them)",
    "evict_blocks": "blocks evicted to keep the pool within its budget",
    "evict_child_failed": "eviction runs whose child process could not start, crashed, hung past "
                          "TLLM_GDS_KV_EVICT_TIME_LIMIT_S or gave no report (retried at the next interval)",
    "load_latency_seconds": "load batches, from acceptance to the last byte",
    "save_latency_seconds": "save batches, from acceptance to the last byte published",
    "pool_usage_bytes": "bytes the quota is held against (block and arena reference files), as an owner's "
                        "evictor last scanned them",
    "pool_quota_bytes": "the pool's quota (TLLM_GDS_KV_QUOTA_BYTES times its roots)",
    "transfer_queued_load_batches": "load batches waiting for a transfer thread",
    "transfer_queued_save_batches": "save batches waiting for a transfer thread",
    "transfer_inflight_batches": "transfer batches accepted and not settled",
    "transfer_save_backlog_bytes": "bytes of saves accepted and not done (TLLM_GDS_KV_MAX_QUEUED_SAVE_BYTES)",
    "arena_used_slots": "arena slots holding blocks",
    "arena_owned_slots": "arena slots in the slabs an owner holds",
}


@dataclass
class PoolView:
    """What one scrape read: live owners (newest process per owner id) and the pool's sums."""

    owners: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, int] = field(default_factory=dict)
    processes: int = 0  # stats files read, of live and exited processes
    retired: int = 0  # processes whose files gc folded into the archive


def read_pool(roots: Sequence[str], now: float) -> PoolView:
    """Every root's stats files merged as ``gds-kv stats`` merges them: owners publish into every
    root, so per process start the newest file counts, once; a file an archive already folded is
    counted there, and the archive's counters are the largest any root's holds."""
    archives = [a for a in map(read_retired, roots) if a is not None]
    folded = {stem for a in archives for stem in a.folded}
    files: dict[str, dict[str, Any]] = {}
    for root in roots:
        for stem, entry in read_owner_stats(root).items():
            if stem not in folded and (entry["updated_ns"] or 0) >= (files.get(stem, {}).get("updated_ns") or 0):
                files[stem] = entry
    counters: Counter[str] = Counter()
    for a in archives:
        for k, v in a.counters.items():
            counters[k] = max(counters[k], v)
    now_ns = int(now * 1e9)
    running = [e for e in files.values() if live(e, now_ns)]
    for e in files.values():
        counters.update(e["counters"])
    return PoolView(_newest_per_owner(running), dict(counters), _live_gauges(running), len(files),
                    max((a.retired for a in archives), default=0))


def _newest_per_owner(entries: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        if (e["started_ns"] or 0) >= (out.get(e["owner"], {}).get("started_ns") or 0):
            out[e["owner"]] = e
    return out


def _live_gauges(entries: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Gauges summed over live owners, except the pool's own (:data:`POOL_GAUGES`): the largest."""
    out: Counter[str] = Counter()
    for e in entries:
        for k, v in e["gauges"].items():
            out[k] = max(out[k], v) if k in POOL_GAUGES else out[k] + v
    return dict(out)


class _Families:
    """Metric families by name, made on first use: one scrape's output.  The first sample of a series
    wins: one whose kind or label names differ from its family's (a counter and a gauge of one name),
    or that repeats a series (``x_us`` and ``x_seconds`` in one file), is left out, since Prometheus
    refuses a whole scrape over either."""

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[Metric, tuple[str, ...]]] = {}
        self._series: set[tuple[str, tuple[str, ...]]] = set()

    def add(self, kind: type[Metric], name: str, doc: str, labels: Sequence[str], values: Sequence[str],
            **sample: Any) -> None:
        family, names = self._by_name.get(name) or (None, tuple(labels))
        if family is None:
            family = kind(name, doc, labels=list(labels))
            self._by_name[name] = (family, names)
        series = (name, tuple(values))
        if type(family) is kind and names == tuple(labels) and series not in self._series:
            self._series.add(series)
            family.add_metric(list(values), **sample)

    def all(self) -> list[Metric]:
        return [family for family, _ in self._by_name.values()]


def counter_family(name: str) -> tuple[str, dict[str, str], float] | None:
    """The family (less prefix and ``_total``), its extra labels and the divisor to its unit of a
    stats-file counter; None for a name Prometheus could not carry."""
    for prefix, family in CAUSES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return family, {"cause": name[len(prefix):]}, 1.0
    base, per = name, 1.0
    for suffix, unit, per_second in UNITS:
        if name.endswith(suffix):
            base, per = name[:-len(suffix)] + unit, per_second
            break
    return (base, {}, per) if _NAME.fullmatch(base) else None


def _histogram_family(name: str) -> tuple[str, float] | None:
    """A histogram's family and divisor: only durations (``_us``, ``_ms``) are histograms here."""
    for suffix, unit, per_second in UNITS:
        if name.endswith(suffix) and _NAME.fullmatch(name[:-len(suffix)]):
            return name[:-len(suffix)] + unit, per_second
    return None


def _add_numbers(out: _Families, prefix: str, labels: dict[str, str], counters: Mapping[str, int],
                 gauges: Mapping[str, int]) -> None:
    """One owner's (or the pool's) counters, histograms and gauges into ``out``."""
    plain, hists = split_histograms({**dict.fromkeys(ZERO_COUNTERS, 0), **counters})
    for name, value in plain.items():
        fam = counter_family(name)
        if fam is not None:
            base, extra, per = fam
            keys = {**labels, **extra}
            out.add(CounterMetricFamily, prefix + base, _doc(base), list(keys), list(keys.values()),
                    value=value / per)
    for name in ZERO_HISTOGRAMS:
        hists.setdefault(name, Histogram(LATENCY_BOUNDS_US, (0,) * len(LATENCY_BOUNDS_US), 0, 0))
    for name, h in hists.items():
        fam = _histogram_family(name)
        if fam is not None:
            base, per = fam
            out.add(HistogramMetricFamily, prefix + base, _doc(base), list(labels), list(labels.values()),
                    buckets=_buckets(h, per), sum_value=h.total / per)
    for name, value in gauges.items():
        if _NAME.fullmatch(name):
            out.add(GaugeMetricFamily, prefix + name, _doc(name), list(labels), list(labels.values()), value=value)


def _buckets(h: Histogram, per: float) -> list[tuple[str, float]]:
    return [(floatToGoString(b / per), c) for b, c in zip(h.bounds, h.cumulative)] + [("+Inf", h.count)]


def _doc(name: str) -> str:
    return DOCS.get(name, f"{name}, from the owners' stats files")


class PoolCollector(Collector):
    """A custom collector: each ``collect`` (each scrape) reads the pool's stats files afresh."""

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(roots)

    def describe(self) -> list[Metric]:
        return []  # what a pool's files hold is known only once read: no read at registration

    def collect(self) -> Iterator[Metric]:
        """The exporter's own series first, so that no stats file's name can take theirs."""
        view = read_pool(self.roots, time.time())
        out = _Families()
        out.add(GaugeMetricFamily, PREFIX + "owners_live", "owner processes publishing now", (), (),
                value=len(view.owners))
        out.add(GaugeMetricFamily, PREFIX + "owners_published", "owner processes with a stats file, live or exited",
                (), (), value=view.processes)
        out.add(GaugeMetricFamily, PREFIX + "owners_retired", "owner processes whose stats files gc folded into "
                "the archive", (), (), value=view.retired)
        for root in self.roots:
            _add_filesystem(out, root)
        for owner, e in sorted(view.owners.items()):
            labels = {"owner": owner, "host": e["host"] or ""}
            out.add(GaugeMetricFamily, OWNER_PREFIX + "last_update_timestamp_seconds",
                    "when the owner last wrote its stats file", OWNER_LABELS, list(labels.values()),
                    value=(e["updated_ns"] or 0) / 1e9)
            _add_numbers(out, OWNER_PREFIX, labels, e["counters"], e["gauges"])
        _add_numbers(out, PREFIX, {}, view.counters, view.gauges)
        yield from out.all()


def _add_filesystem(out: _Families, root: str) -> None:
    """The free and total bytes of a root's filesystem (one statfs call): the bound of a pool
    without a quota, at no cost per scrape."""
    try:
        st = os.statvfs(root)
    except OSError:
        return
    for name, value, doc in (("free_bytes", st.f_bavail * st.f_frsize, "free bytes of the root's filesystem"),
                             ("size_bytes", st.f_blocks * st.f_frsize, "size of the root's filesystem")):
        out.add(GaugeMetricFamily, f"{PREFIX}filesystem_{name}", doc, ("root",), (root,), value=value)


def registry_for(roots: Sequence[str]) -> CollectorRegistry:
    """A registry holding only the pool's collector (the exporter's own process is not the subject)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(roots))
    return registry


def exposition(roots: Sequence[str]) -> str:
    """One scrape's worth, in Prometheus's text format."""
    return generate_latest(registry_for(roots)).decode()


def listen(roots: Sequence[str], address: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Answer scrapes on ``address:port`` (every path) from a daemon thread, each on a thread of its
    own, until the caller shuts the server down.  A port taken fails here, naming it."""
    try:
        return start_http_server(port, addr=address or "0.0.0.0", registry=registry_for(roots))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, f"{address or '*'}:{port}") from None
