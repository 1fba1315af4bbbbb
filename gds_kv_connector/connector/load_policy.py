"""Load a matched prefix only when that beats computing it (``TLLM_GDS_KV_LOAD_POLICY``).

A prefix in the pool is worth loading only if its bytes arrive before the GPU could have computed
its KV.  Both sides are measured in the serving process, never configured:

* load time: :class:`LoadRate`, the bytes per second of this worker's loads (its pool roots
  through its engine), counted over the time at least one load batch runs, so batches running
  side by side on the transfer threads count once; a prefix's load is expected to take the bytes
  of the loads still queued plus its own at that rate.  A pool's blocks are spread over its roots
  by key, so every load reads from all of them at once and one figure per worker is what a load
  waits for.  Until the first load is measured, and again once no load has been measured for
  :data:`REPROBE_S` (the policy declined them all), a load is offered: the figure is optimistic,
  never a configured or benched one, since a pessimistic figure would never be corrected (nothing
  would be loaded to measure it), and a page cache, a neighbour's traffic or another owner's
  arena make a host's figure change while it serves.  Being wrong costs one slow load per
  :data:`REPROBE_S`.  An asynchronous load also costs time that no byte explains: its batches
  wait for a transfer thread and the forward's event, and its request resumes only once a poll
  (``get_finished``) reports it.  Each such load is timed from its acceptance to that poll; what it
  took beyond its bytes (and those queued ahead of it) at the measured rate is faded into
  :meth:`LoadRate.fixed_s`, which a parked load is expected to cost on top of its bytes.  Against
  a short prefix, whose compute takes milliseconds, this decides.
* compute time: :class:`ForwardCost`, the seconds of this worker's forwards that compute prompt
  tokens, fitted to ``fixed + a * tokens + b * attention pairs`` (a token at position ``p``
  attends ``p + 1`` keys: prefill cost grows with the context, and a 128k-token prefix costs
  more per token than a 1k one).  The worker times each forward (CUDA events from the first layer
  hook to ``wait_for_save``, after any synchronous load it waited for; the host clock for a host
  pool) and the scheduler, which sees every scheduled request's tokens and position, supplies its
  work (:meth:`ForwardClock.note_work`).  A forward that computes no prompt token (decode only)
  says nothing about prefill and is not a sample.  The fixed part is paid by the forward that
  follows a load too, so computing a prefix is expected to cost ``a * tokens + b * pairs``.
* what a load costs after its bytes: the first forward of a request whose prefix was loaded is
  not a compute sample (what it costs beyond its tokens is the load's: its suffix attends to KV
  read from the pages, and a fit that took it in would move a prefill's cost into the fixed part,
  where the load path pays it too); its time beyond the fit's prediction for its work is faded
  into :meth:`ForwardClock.after_load_s`, and for a parked request so is the time from the poll
  that reported its load to that forward's start (its resume).  A load is expected to cost that
  on top of its bytes and, parked, :meth:`LoadRate.fixed_s`.

Modes: ``always`` offers every match (no measurement; the default, as before this setting);
``latency`` offers a prefix when its expected load time is below its expected compute time, for
the request's own time to first token; ``throughput`` counts GPU time only: an asynchronous load
parks its request while the GPU computes other requests, so it costs the GPU nothing and saves
the prefix's compute, and is offered whenever it is expected to finish; a synchronous one holds
the whole batch's forward for its duration and follows the latency rule.  Every mode but
``always`` declines a load expected to take more than half the transfer deadline (it would fail
the process).  The decision is the whole prefix or nothing: the
compute a shorter prefix would save grows faster than its load time (attention), so when the
whole prefix does not beat computing it, no shorter one does.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

MODES = ("always", "latency", "throughput")
# A load figure older than this is forgotten and the next offer is a probe: a pool that got faster
# while every load was declined is measured again, at the cost of one slow load at most this often.
REPROBE_S = 60.0
# Load samples fade by half for every this many newer bytes: a 4 GiB load outweighs the 1 MiB ones
# before it, and a cold pool's figure turns into a warm one's within a few loads.
RATE_HALF_BYTES = 1 << 30
# A busy period is cut into samples of at most this long, so a pool that is never idle still updates.
SAMPLE_S = 1.0
# What a load costs beyond its bytes (a parked load's fixed cost, a loaded request's forward and
# resume) fades by this factor per newer load: about the last 5 loads count.
FIXED_FORGET = 0.8
# Forward samples fade by this factor per newer sample: about the last 20 prefill forwards count.
FORGET = 0.95
# Feature units (1, kilotokens, megapairs) and the ridge on each coefficient.  The ridge only
# decides what the data leave open: with one prompt shape seen, cost is put on tokens, not on the
# fixed part (it would make the saving nothing) or on attention (it would extrapolate quadratically).
TOKEN_UNIT, PAIR_UNIT = 1e3, 1e6
RIDGE = (1e-3, 1e-9, 1e-5)
MAX_PENDING_FORWARDS = 64  # timed forwards whose end has not been read yet (a stuck stream drops the oldest)
# Parked requests whose load was reported and whose first forward has not started yet, at most: one
# the runtime never schedules (cancelled while parked) is forgotten once this many came after it.
MAX_RESUMING = 4096


class LoadRate:
    """Bytes per second of this worker's loads, counted while at least one load batch runs.

    The transfer manager calls :meth:`started` when a batch begins moving bytes (after the event
    it waits for) and :meth:`ended` with the bytes it moved when it returns; a period from the
    first batch starting to the last one ending (or :data:`SAMPLE_S`) is one sample, dropped if a
    batch in it failed or was stopped (its time would count without its bytes).  :meth:`queue`
    counts the bytes of load batches accepted and not yet settled, which a new load waits behind.
    Thread-safe: transfer threads report, the scheduler reads."""

    def __init__(self, key: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.key = key  # the pool roots and engine the figure is for
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._since = 0.0  # start of the current busy period
        self._bytes = 0  # moved in it so far
        self._tainted = False
        self._sum_bytes = 0.0  # faded sums of the samples: their ratio is the rate
        self._sum_s = 0.0
        self._last = -math.inf  # when the last sample was taken
        self._fixed = [0.0, 0.0]  # faded sum and count of the parked loads' fixed costs
        self.queued_bytes = 0

    def now(self) -> float:
        return self._clock()

    def queue(self, nbytes: int) -> None:
        with self._lock:
            self.queued_bytes += nbytes

    def started(self) -> None:
        with self._lock:
            if self._running == 0:
                self._since, self._bytes, self._tainted = self._clock(), 0, False
            self._running += 1

    def ended(self, nbytes: int) -> None:
        """A batch returned having moved ``nbytes``; 0 means it failed or stopped."""
        with self._lock:
            self._running -= 1
            self._bytes += nbytes
            self._tainted |= nbytes <= 0
            now = self._clock()
            if self._running == 0 or now - self._since >= SAMPLE_S:
                if not self._tainted and self._bytes and now > self._since:
                    self._fold(self._bytes, now - self._since, now)
                self._since, self._bytes, self._tainted = now, 0, False

    def settled(self, seconds: float, nbytes: int) -> None:
        """An asynchronous load was reported done ``seconds`` after its acceptance, behind ``nbytes``
        of loads (its own and those queued ahead of it): its time beyond those bytes at the measured
        rate is one sample of a parked load's fixed cost (module docstring)."""
        rate = self.bytes_per_s()
        if rate is None:
            return
        with self._lock:
            _fade(self._fixed, max(0.0, seconds - nbytes / rate))

    def fixed_s(self) -> float:
        """Seconds a parked load is expected to cost beyond its bytes; 0 before any was measured."""
        with self._lock:
            return _faded_mean(self._fixed)

    def _fold(self, nbytes: int, seconds: float, now: float) -> None:
        if now - self._last > REPROBE_S:  # what was known before the gap says nothing now
            self._sum_bytes = self._sum_s = 0.0
        keep = 0.5 ** (nbytes / RATE_HALF_BYTES)
        self._sum_bytes = self._sum_bytes * keep + nbytes
        self._sum_s = self._sum_s * keep + seconds
        self._last = now

    def bytes_per_s(self) -> float | None:
        """The measured rate; None before the first sample and once the last is older than REPROBE_S."""
        with self._lock:
            if self._clock() - self._last > REPROBE_S or self._sum_s <= 0:
                return None
            return self._sum_bytes / self._sum_s

    def seconds_for(self, nbytes: int, parked: bool = False) -> float | None:
        """Expected time until a load of ``nbytes`` submitted now has moved its last byte, and for a
        ``parked`` (asynchronous) one, until its request may resume."""
        rate = self.bytes_per_s()
        if rate is None:
            return None
        return (max(self.queued_bytes, 0) + nbytes) / rate + (self.fixed_s() if parked else 0.0)


class ForwardCost:
    """Seconds of a forward fitted to ``fixed + a * tokens + b * pairs`` by faded least squares
    with non-negative coefficients (each subset of them solved, the best feasible one kept)."""

    def __init__(self) -> None:
        self._xx = [[0.0] * 3 for _ in range(3)]  # faded sums of x x^T, x y and y y
        self._xy = [0.0] * 3
        self._yy = 0.0
        self._coef: tuple[float, float, float] | None = None
        self.samples = 0

    def add(self, seconds: float, tokens: int, pairs: int) -> None:
        x = (1.0, tokens / TOKEN_UNIT, pairs / PAIR_UNIT)
        for i in range(3):
            row = self._xx[i]
            for j in range(3):
                row[j] = row[j] * FORGET + x[i] * x[j]
            self._xy[i] = self._xy[i] * FORGET + x[i] * seconds
        self._yy = self._yy * FORGET + seconds * seconds
        self.samples += 1
        self._coef = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed seconds, seconds per kilotoken, seconds per megapair); None before any sample."""
        if not self.samples:
            return None
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def prefill_s(self, start: int, tokens: int) -> float | None:
        """Expected seconds to compute prompt tokens ``[start, start + tokens)`` beyond the forward's
        fixed part; None before any prefill forward was measured."""
        coef = self.coefficients()
        if coef is None:
            return None
        pairs = tokens * start + tokens * (tokens + 1) // 2
        return coef[1] * tokens / TOKEN_UNIT + coef[2] * pairs / PAIR_UNIT

    def _fit(self) -> tuple[float, float, float]:
        best, best_err = (0.0, 0.0, 0.0), self._yy
        for size in (3, 2, 1):
            for subset in combinations(range(3), size):
                coef = _solve([[self._xx[i][j] + (RIDGE[i] if i == j else 0.0) for j in subset] for i in subset],
                              [self._xy[i] for i in subset])
                if coef is None or min(coef) < 0:
                    continue
                full = [0.0, 0.0, 0.0]
                for i, c in zip(subset, coef):
                    full[i] = c
                err = self._objective(full)
                if err < best_err:
                    best, best_err = tuple(full), err
        return best  # type: ignore[return-value]

    def _objective(self, c: list[float]) -> float:
        """Faded squared error plus ridge of coefficients ``c``, from the sums alone."""
        quad = sum(c[i] * self._xx[i][j] * c[j] for i in range(3) for j in range(3))
        return self._yy - 2 * sum(c[i] * self._xy[i] for i in range(3)) + quad + sum(
            r * v * v for r, v in zip(RIDGE, c))


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` by Gaussian elimination with partial pivoting; None when ``m`` is singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class ForwardClock:
    """Times the worker's forwards that compute prompt tokens: feeds :class:`ForwardCost`, and
    measures what a loaded prefix costs its request after its bytes (:meth:`after_load_s`).

    ``mark(stream)`` stamps a point on the forward stream (a CUDA timing event, or the host clock
    for a host pool) and ``elapsed(start, end)`` reads the seconds between two stamps, None while
    the end has not been reached; stamps are read without waiting, in :meth:`collect` (the
    worker's ``get_finished``, every iteration).  The scheduler adds each iteration's work before
    its forward (:meth:`note_work`); a forward takes all the work noted since the last one.  The
    worker says when a parked request's load was reported done (:meth:`loads_reported`), on the
    host clock ``now``."""

    def __init__(self, cost: ForwardCost, mark: Callable[[Any], Any],
                 elapsed: Callable[[Any, Any], float | None], now: Callable[[], float] = time.monotonic) -> None:
        self.cost = cost
        self._mark, self._elapsed, self._now = mark, elapsed, now
        self._tokens = self._pairs = 0
        self._prefill = False
        self._after: list[int] = []  # requests of the noted work on their first forward after a load
        self._start: Any = None
        self._begun = 0.0  # host time of the forward's start, for the resumes of its parked requests
        self._pending: deque[tuple[Any, Any, int, int, bool, list[float]]] = deque(maxlen=MAX_PENDING_FORWARDS)
        self._reported: dict[int, float] = {}  # parked request -> when its load was reported done
        self._reservations: dict[int, int] = {}  # parked prefix reservation -> its request
        self._extra = [0.0, 0.0]  # faded sum and count: a loaded request's forward beyond the fit
        self._resume = [0.0, 0.0]  # the same for a parked request's wait from its report to its forward

    def note_work(self, spans: Iterable[tuple[int, int, bool]], after_load: Iterable[int] = ()) -> None:
        """Scheduled work of one plan: (tokens computed before, tokens scheduled, whether prompt) per
        request, and the requests among them on their first forward after a prefix load."""
        for before, n, prompt in spans:
            self._tokens += n
            self._pairs += n * before + n * (n + 1) // 2
            self._prefill |= prompt
        self._after.extend(after_load)

    def expect_reservation(self, reservation: int, request_id: int) -> None:
        """A parked prefix reservation's load was handed over: its report resumes ``request_id``."""
        self._reservations[reservation] = request_id
        _bound(self._reservations)

    def loads_reported(self, request_ids: Iterable[int], reservations: Iterable[int] = ()) -> None:
        """These parked requests' (and reservations') loads were reported done now."""
        now, reported = self._now(), self._reported
        for rid in request_ids:
            reported[rid] = now
        for res in reservations:
            rid = self._reservations.pop(res, None)
            if rid is not None:
                reported[rid] = now
        _bound(reported)

    def begin(self, stream: Any) -> None:
        """The forward's first layer is about to run (any synchronous load it waited for is in)."""
        if (self._prefill or self._after) and self._start is None:
            self._start = self._mark(stream)
            if self._after:
                self._begun = self._now()

    def end(self, stream: Any) -> None:
        """The forward is queued (``wait_for_save``): its work becomes a sample once its end is reached."""
        start, tokens, pairs, after = self._start, self._tokens, self._pairs, self._after
        self._start, self._tokens, self._pairs, self._prefill, self._after = None, 0, 0, False, []
        if start is None:
            return
        waits = [self._begun - t for rid in after if (t := self._reported.pop(rid, None)) is not None]
        self._pending.append((start, self._mark(stream), tokens, pairs, bool(after), waits))
        self.collect()

    def collect(self) -> None:
        pending = self._pending
        while pending:
            start, end, tokens, pairs, after, waits = pending[0]
            seconds = self._elapsed(start, end)
            if seconds is None:
                return
            pending.popleft()
            if after:
                self._after_load(seconds, tokens, pairs, waits)
            else:
                self.cost.add(seconds, tokens, pairs)

    def _after_load(self, seconds: float, tokens: int, pairs: int, waits: list[float]) -> None:
        coef = self.cost.coefficients()
        if coef is None:  # nothing to tell the load's part from the work's yet
            return
        expected = coef[0] + coef[1] * tokens / TOKEN_UNIT + coef[2] * pairs / PAIR_UNIT
        _fade(self._extra, max(0.0, seconds - expected))
        for wait in waits:
            _fade(self._resume, max(0.0, wait))

    def after_load_s(self, parked: bool) -> float:
        """Seconds a loaded prefix is expected to cost its request beyond its bytes, once they are
        in: its first forward's time beyond its work's, and for a ``parked`` one its resume."""
        return _faded_mean(self._extra) + (_faded_mean(self._resume) if parked else 0.0)


def _fade(acc: list[float], sample: float) -> None:
    """Fold ``sample`` into a faded [sum, count] (about the last 5 count)."""
    acc[0] = acc[0] * FIXED_FORGET + sample
    acc[1] = acc[1] * FIXED_FORGET + 1.0


def _faded_mean(acc: list[float]) -> float:
    return acc[0] / acc[1] if acc[1] else 0.0


def _bound(entries: dict[int, Any]) -> None:
    """Forget the oldest of ``entries`` past :data:`MAX_RESUMING`."""
    while len(entries) > MAX_RESUMING:
        del entries[next(iter(entries))]


@dataclass
class LoadEstimates:
    """What a worker measures for its scheduler's policy (shared through ``PeerInfo``)."""

    rate: LoadRate
    forwards: ForwardClock


class LoadPolicy:
    """The scheduler's decision whether to offer a matched prefix (module docstring)."""

    def __init__(self, mode: str, estimates: LoadEstimates, block_bytes: int, tokens_per_block: int,
                 deadline_s: float) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"LoadPolicy serves latency or throughput, not {mode!r}")
        self.mode, self.estimates = mode, estimates
        self._block_bytes, self._tpb, self._deadline_s = block_bytes, tokens_per_block, deadline_s
        self._last: bool | None = None

    def expected(self, first_block: int, blocks: int, is_async: bool) -> tuple[float | None, float | None]:
        """(seconds until blocks ``[first_block, first_block + blocks)`` loaded let their request
        go on, seconds to compute them); each None while it is not measured."""
        est = self.estimates
        load_s = est.rate.seconds_for(blocks * self._block_bytes, parked=is_async)
        if load_s is not None:
            load_s += est.forwards.after_load_s(is_async)
        return load_s, est.forwards.cost.prefill_s(first_block * self._tpb, blocks * self._tpb)

    def offers(self, first_block: int, blocks: int, is_async: bool) -> bool:
        """Whether to load blocks ``[first_block, first_block + blocks)`` rather than compute them."""
        load_s, compute_s = self.expected(first_block, blocks, is_async)
        if load_s is None:
            return True  # not measured yet, or not for REPROBE_S: load, and measure
        if load_s > self._deadline_s / 2:
            offer = False
        elif self.mode == "throughput" and is_async:
            offer = True
        else:
            offer = compute_s is None or load_s < compute_s
        self._log_flip(offer, blocks, load_s, compute_s)
        return offer

    def _log_flip(self, offer: bool, blocks: int, load_s: float, compute_s: float | None) -> None:
        """One line whenever the answer changes, with the figures it came from."""
        if offer is self._last:
            return
        self._last = offer
        rate = self.estimates.rate
        log.info("gds-kv-connector: load policy %s now %s (e.g. %d blocks: load %.3fs at %.2f GB/s from %s, "
                 "compute %s); further decisions are counted (policy_loads_declined)", self.mode,
                 "loads" if offer else "recomputes", blocks, load_s, (rate.bytes_per_s() or 0) / 1e9, rate.key,
                 "not measured" if compute_s is None else f"{compute_s:.3f}s")
