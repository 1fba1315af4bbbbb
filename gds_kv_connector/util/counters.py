"""Counters every owner keeps; thread-safe, cheap on the hot path, readable as a plain dict.

Besides counters a :class:`Stats` keeps latency histograms and asks its gauge sources for what the
process holds now.  A histogram travels in the owner's stats file as counters (:func:`encode_histogram`
writes them, :func:`split_histograms` reads them back): its cumulative bucket counts, its sum and
its count each only grow, so a histogram summed over owners, or kept in the archive of retired
owners, is still a histogram, and every reader of stats files already checks and sums counters.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# Upper bounds (microseconds) of the latency buckets: 100 us to a minute (the transfer deadline's
# default), 1-2.5-5 per decade.  Fixed: a histogram summed over owners adds bucket to bucket, so an
# owner with other bounds would corrupt the sum; new bounds need a new histogram name.
LATENCY_BOUNDS_US: tuple[int, ...] = (100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000,
                                      250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
                                      30_000_000, 60_000_000)
_BUCKET = "_le_"
_BUCKET_NAME = re.compile(r"(?P<name>[a-z][a-z0-9_]*)_le_(?P<bound>[0-9]{1,15})")

GaugeSource = Callable[[], Mapping[str, int]]


@dataclass(frozen=True)
class Histogram:
    """One histogram read back from counters: ``cumulative[i]`` observations were at most
    ``bounds[i]``; ``count`` in all (the +Inf bucket), adding up to ``total``."""

    bounds: tuple[int, ...]
    cumulative: tuple[int, ...]
    count: int
    total: int


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._hist: dict[str, list[int]] = {}  # name -> per-bucket counts, the last past every bound
        self._hist_sum: Counter[str] = Counter()
        self._gauges: list[GaugeSource] = []

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def add_many(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                if v:
                    self._c[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def observe_us(self, name: str, us: int) -> None:
        """One observation of the latency histogram ``name`` (which should end in ``_us``): a
        bucket index and two additions under the lock, cheap enough for every transfer batch."""
        i = bisect.bisect_left(LATENCY_BOUNDS_US, us)
        with self._lock:
            counts = self._hist.get(name)
            if counts is None:
                counts = self._hist[name] = [0] * (len(LATENCY_BOUNDS_US) + 1)
            counts[i] += 1
            self._hist_sum[name] += max(us, 0)

    def histogram_counters(self) -> dict[str, int]:
        """Every histogram as the counters of a stats file (:func:`encode_histogram`)."""
        with self._lock:
            hists = {name: (list(counts), self._hist_sum[name]) for name, counts in self._hist.items()}
        out: dict[str, int] = {}
        for name, (counts, total) in hists.items():
            out.update(encode_histogram(name, counts, total))
        return out

    def add_gauges(self, source: GaugeSource) -> None:
        """Call ``source`` for gauges at each :meth:`gauges` (the stats thread, every interval): what
        a component holds now is read where it is kept, not copied into counters as it changes."""
        with self._lock:
            self._gauges.append(source)

    def gauges(self) -> dict[str, int]:
        with self._lock:
            sources = list(self._gauges)
        out: dict[str, int] = {}
        for source in sources:
            out.update(source())
        return out


def encode_histogram(name: str, counts: list[int], total: int) -> dict[str, int]:
    """A histogram of per-bucket ``counts`` (bounds :data:`LATENCY_BOUNDS_US`, then one past them)
    as counters: ``<name>_le_<bound>`` cumulative per bound, ``<name>_count`` and ``<name>_sum``."""
    out, running = {}, 0
    for bound, n in zip(LATENCY_BOUNDS_US, counts):
        running += n
        out[f"{name}{_BUCKET}{bound}"] = running
    out[f"{name}_count"] = running + counts[-1]
    out[f"{name}_sum"] = total
    return out


def split_histograms(counters: Mapping[str, int]) -> tuple[dict[str, int], dict[str, Histogram]]:
    """``counters`` less the histograms among them, and those histograms by name.  A histogram is
    read only whole and consistent (a count and a sum, bucket counts that never fall and end at most
    at the count): a stats file anyone could have written yields none rather than a wrong one, and
    its counters are then dropped with it."""
    buckets: dict[str, dict[int, int]] = {}
    for key, value in counters.items():
        m = _BUCKET_NAME.fullmatch(key)
        if m is not None:
            buckets.setdefault(m["name"], {})[int(m["bound"])] = value
    hists: dict[str, Histogram] = {}
    for name, by_bound in buckets.items():
        bounds = tuple(sorted(by_bound))
        cumulative = tuple(by_bound[b] for b in bounds)
        count, total = counters.get(f"{name}_count"), counters.get(f"{name}_sum")
        if count is None or total is None:
            continue
        if all(a <= b for a, b in zip(cumulative, cumulative[1:] + (count,))):
            hists[name] = Histogram(bounds, cumulative, count, total)
    taken = {k for k in counters if (m := _BUCKET_NAME.fullmatch(k)) is not None and m["name"] in buckets}
    taken |= {f"{name}{suffix}" for name in buckets for suffix in ("_count", "_sum")}
    return {k: v for k, v in counters.items() if k not in taken}, hists
