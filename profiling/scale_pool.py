"""Synthetic pools of millions of valid blocks, for profiling/scale_bench.py.

A pool built here is one a real owner would accept block by block:

* Its layout directory, ``fingerprint.json``, ``owners/`` and ``quarantine/`` are made by a real worker
  (:func:`open_connector`: the connector's scheduler and worker over a small CPU KV cache), so the
  fingerprint is the one an owner of that geometry computes and start-up, match, stats and verify
  see the pool as theirs.
* Each block file is named and laid out as the connector writes it (docs/format.md): the real
  :class:`BlockHeader` with the real checksum of its payload, then the payload page.  The payload is all
  zeros, written as a hole (``ftruncate``): 4 KiB on disk per file, 8 KiB apparent, so 10M blocks fit
  where 80 GB would not.  No temporary name and no fsync: nobody else writes the pool while it is built.
* Keys chain from the chain seed through real tokens (:func:`block_keys` / :func:`chain_from_tokens`):
  every ``BLOCKS_PER_PREFIX`` blocks share one ``PREFIX_BLOCKS``-block prefix (a system prompt), each
  conversation adds its own suffix, and one ``MATCH_BLOCKS``-block chain is the match benchmark's.
  Headers name their parents, so eviction sees trees and peels their tails first.
* Creation times (header and mtime alike) spread over ``SPAN_S`` before the build; a
  ``TOUCHED_FRACTION`` of the conversations were accessed later, by one of ``OWNERS`` owners, recorded
  through the real access log (:class:`RecencyLog`).

Everything is a function of (blocks, seed, build time), so the removals of a destructive benchmark
can be put back (:func:`restore`) by writing the oldest conversations again where they are missing.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from gds_kv_connector.format.checksum import CHECKSUM_ALGO, checksum_bytes
from gds_kv_connector.format.keys import chain_from_tokens, chain_seed
from gds_kv_connector.format.layout import BLOCK_SUFFIX, LAYOUT_DIR
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader, file_size_for
from gds_kv_connector.maintenance.recency import RecencyLog

MODEL = "scale-bench"
TOKENS_PER_BLOCK = 16
KV_SHAPE = (1, 2, 1024)  # layers, K/V, elements per plane of a block: float16, so 4096 payload bytes
VOCAB = 32000
PREFIX_BLOCKS = 8
BLOCKS_PER_PREFIX = 2000
SUFFIX_MIN, SUFFIX_MAX = 4, 28
MATCH_BLOCKS = 4096
SPAN_S = 6 * 3600
NEWEST_AGE_S = 900  # the newest conversation is this old at build time: well outside the eviction grace
TOUCHED_FRACTION = 0.1
OWNERS = 4
RESTORE_FACTOR = 3  # restore() rewrites the oldest conversations covering this many times the removal target
META_NAME = "scale-pool.json"
META_VERSION = 1
TASK_CHAINS = 2000
_PREFIX_TAG, _MATCH_TAG = 1 << 40, 1 << 41


@dataclass
class PoolMeta:
    """What a built pool is and how to rebuild any of its blocks."""

    blocks: int
    seed: int
    built_ns: int
    root: str
    fingerprint: str
    payload_len: int
    chains: int
    prefixes: int
    build_s: float = 0.0
    build_rate: float = 0.0
    processes: int = 1
    target: int = 10_000  # blocks the destructive benchmarks remove
    expire_cutoff_ns: int = 0  # a --max-age reaching back to here removes about ``target`` blocks
    old_chains: list[int] = field(default_factory=list)  # oldest conversations first, for restore()
    version: int = META_VERSION

    @property
    def file_size(self) -> int:
        return file_size_for(self.payload_len)

    @property
    def bytes(self) -> int:
        return self.blocks * self.file_size


@dataclass(frozen=True)
class Plan:
    """Every conversation's prefix, suffix length, creation and access time: one array each."""

    prefixes: int
    lengths: np.ndarray
    created_ns: np.ndarray
    accessed_ns: np.ndarray  # 0: never accessed
    owner: np.ndarray

    @property
    def recency_ns(self) -> np.ndarray:
        """What an evictor sees: the newer of the tail's creation and the last access."""
        tail = self.created_ns + (self.lengths.astype(np.int64) - 1) * 1_000_000
        return np.maximum(tail, self.accessed_ns)


def plan(blocks: int, seed: int, built_ns: int) -> Plan:
    prefixes = max(1, blocks // BLOCKS_PER_PREFIX)
    rest = blocks - MATCH_BLOCKS - prefixes * PREFIX_BLOCKS
    if rest < SUFFIX_MAX:
        raise ValueError(f"a pool needs at least {MATCH_BLOCKS + PREFIX_BLOCKS + SUFFIX_MAX} blocks, not {blocks}")
    rng = np.random.default_rng((seed, 0))
    lengths = rng.integers(SUFFIX_MIN, SUFFIX_MAX + 1, size=rest // SUFFIX_MIN + 1)
    ends = np.cumsum(lengths)
    n = int(np.searchsorted(ends, rest)) + 1
    lengths = lengths[:n].copy()
    lengths[-1] -= int(ends[n - 1]) - rest  # the last conversation ends the pool exactly at ``blocks``
    span = (SPAN_S - NEWEST_AGE_S) * 10**9
    created = built_ns - SPAN_S * 10**9 + (rng.random(n) * span).astype(np.int64)
    touched = rng.random(n) < TOUCHED_FRACTION
    newest = built_ns - NEWEST_AGE_S * 10**9
    accessed = np.where(touched, created + (rng.random(n) * (newest - created)).astype(np.int64), 0)
    return Plan(prefixes, lengths, created, accessed, rng.integers(0, OWNERS, size=n))


def _tokens(seed: int, tag: int, n: int) -> list[int]:
    return np.random.default_rng((seed, tag)).integers(0, VOCAB, size=n).tolist()


def match_tokens(seed: int) -> list[int]:
    """The prompt whose first MATCH_BLOCKS blocks are in the pool (one token more: a match leaves one to compute)."""
    return _tokens(seed, _MATCH_TAG, MATCH_BLOCKS * TOKENS_PER_BLOCK + 1)


# -- writing ----------------------------------------------------------------------------------------
class _Writer:
    """Block files of one pool, written by one process."""

    def __init__(self, meta: PoolMeta) -> None:
        self.meta = meta
        self.fp = bytes.fromhex(meta.fingerprint)
        self.fp_dir = os.path.join(meta.root, LAYOUT_DIR, meta.fingerprint[:16])
        self.csum = checksum_bytes(bytes(meta.payload_len))  # every payload is zeros
        self.size = meta.file_size
        self.seed_key = chain_seed(self.fp, None)
        self.written = 0
        self.prefix_keys = [self._prefix_chain(p) for p in range(meta.prefixes)]

    def _prefix_chain(self, p: int) -> list[bytes]:
        toks = _tokens(self.meta.seed, _PREFIX_TAG | p, PREFIX_BLOCKS * TOKENS_PER_BLOCK)
        return chain_from_tokens(self.seed_key, toks, 0, TOKENS_PER_BLOCK, PREFIX_BLOCKS)

    def chain(self, parent: bytes, keys: list[bytes], created_ns: int, step_ns: int, only_missing: bool) -> None:
        """Publish ``keys`` (each the child of the one before; the first of ``parent``) created ``step_ns`` apart."""
        meta = self.meta
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for i, key in enumerate(keys):
            t = created_ns + i * step_ns
            kh = key.hex()
            path = f"{self.fp_dir}/{kh[:2]}/{kh}{BLOCK_SUFFIX}"
            try:
                fd = os.open(path, flags, 0o600)
            except FileExistsError:
                if only_missing:
                    parent = key
                    continue
                raise
            try:
                os.write(fd, BlockHeader(self.fp, key, meta.payload_len, self.csum, CHECKSUM_ALGO, TOKENS_PER_BLOCK,
                                         t, parent).pack())
                os.ftruncate(fd, self.size)
                os.utime(fd, ns=(t, t))
            finally:
                os.close(fd)
            self.written += 1
            parent = key

    def fixed_chains(self) -> None:
        """The shared prefixes (older than every conversation) and the match chain."""
        built = self.meta.built_ns
        for keys in self.prefix_keys:
            self.chain(ZERO_KEY, keys, built - (SPAN_S + 60) * 10**9, 1_000_000, False)
        mkeys = chain_from_tokens(self.seed_key, match_tokens(self.meta.seed), 0, TOKENS_PER_BLOCK, MATCH_BLOCKS)
        self.chain(ZERO_KEY, mkeys, built - 2 * NEWEST_AGE_S * 10**9 // 3, 1_000, False)

    def conversations(self, pl: Plan, ids: range | list[int], only_missing: bool = False) -> None:
        logs: dict[int, RecencyLog] = {}
        try:
            for c in ids:
                p = c % pl.prefixes
                n = int(pl.lengths[c])
                toks = _tokens(self.meta.seed, c, n * TOKENS_PER_BLOCK)
                parent = self.prefix_keys[p][-1]
                keys = chain_from_tokens(parent, toks, 0, TOKENS_PER_BLOCK, n)
                self.chain(parent, keys, int(pl.created_ns[c]), 1_000_000, only_missing)
                if pl.accessed_ns[c] and not only_missing:
                    o = int(pl.owner[c])
                    if o not in logs:
                        logs[o] = RecencyLog(self.meta.root, f"scalehost{o}-{os.getpid()}", flush_interval_s=0)
                    logs[o].touch(self.prefix_keys[p] + keys, int(pl.accessed_ns[c]))
        finally:
            for lg in logs.values():
                lg.flush()
                lg.close()


_STATE: dict[str, object] = {}


def _task_init(meta: PoolMeta) -> None:
    _STATE["writer"] = _Writer(meta)
    _STATE["plan"] = plan(meta.blocks, meta.seed, meta.built_ns)


def _task(task: tuple[str, int, int]) -> int:
    kind, lo, hi = task
    w: _Writer = _STATE["writer"]  # type: ignore[assignment]
    before = w.written
    if kind == "fixed":
        w.fixed_chains()
    else:
        w.conversations(_STATE["plan"], range(lo, hi))  # type: ignore[arg-type]
    return w.written - before


# -- the pool as a whole ----------------------------------------------------------------------------
def check_room(directory: str, blocks: int, payload_len: int = 4096) -> None:
    """Refuse, in one line, a pool the filesystem under ``directory`` cannot hold: each block takes an
    inode, its header page (the payload is a hole) and about 100 bytes of directory entry."""
    os.makedirs(directory, exist_ok=True)
    st = os.statvfs(directory)
    need_bytes = int(blocks * (4096 + 100) * 1.05) + (1 << 30)
    need_inodes = int(blocks * 1.02) + 10_000
    free_bytes, free_inodes = st.f_bavail * st.f_frsize, st.f_favail
    if free_bytes < need_bytes or free_inodes < need_inodes:
        raise SystemExit(f"scale_pool: {blocks} blocks need {need_bytes / 1e9:.1f} GB and {need_inodes} inodes under "
                         f"{directory}, which has {free_bytes / 1e9:.1f} GB and {free_inodes} inodes free")


def open_connector(root: str, num_blocks: int = 64):
    """(scheduler, worker) of this pool's geometry over a CPU KV cache, as an owner starts on ``root``
    (TLLM_GDS_KV_ROOT; other TLLM_GDS_KV_* settings are the caller's)."""
    import torch

    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
    from gds_kv_connector.simulator import fake_llm_args

    os.environ["TLLM_GDS_KV_ROOT"] = root
    llm_args = fake_llm_args(TOKENS_PER_BLOCK, model=MODEL)
    worker = GdsKvConnectorWorker(llm_args)
    worker.register_kv_caches(torch.zeros((num_blocks, *KV_SHAPE), dtype=torch.float16))
    sched = GdsKvConnectorScheduler(llm_args)
    sched.wait_for_initialization()
    return sched, worker


def _layout_by_owner(root: str) -> tuple[str, int]:
    """Run in a child process: a real owner makes the layout; its fingerprint and block size."""
    _, worker = open_connector(root)
    try:
        return worker.pool.fingerprint.hex(), worker.pool.payload_len
    finally:
        worker.shutdown()


def load_meta(directory: str) -> PoolMeta | None:
    try:
        with open(os.path.join(directory, META_NAME)) as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return None
    if raw.get("version") != META_VERSION:
        return None
    return PoolMeta(**raw)


def _save_meta(directory: str, meta: PoolMeta) -> None:
    tmp = os.path.join(directory, META_NAME + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(asdict(meta), fh, indent=1)
    os.replace(tmp, os.path.join(directory, META_NAME))


def build(directory: str, blocks: int, seed: int = 1, processes: int | None = None,
          progress=print) -> PoolMeta:
    """A fresh pool of ``blocks`` blocks at ``directory/pool`` (whatever was in ``directory`` is removed)."""
    check_room(os.path.dirname(os.path.abspath(directory)) or "/", blocks)
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    root = os.path.join(directory, "pool")
    os.makedirs(root)
    ctx = multiprocessing.get_context("spawn")  # the layout child imports torch; the writers must not inherit it
    with ctx.Pool(1) as one:
        fp, payload_len = one.apply(_layout_by_owner, (root,))
    built_ns = time.time_ns()
    pl = plan(blocks, seed, built_ns)
    meta = PoolMeta(blocks=blocks, seed=seed, built_ns=built_ns, root=root, fingerprint=fp, payload_len=payload_len,
                    chains=len(pl.lengths), prefixes=pl.prefixes, processes=processes or os.cpu_count() or 1)
    fp_dir = os.path.join(root, LAYOUT_DIR, fp[:16])
    for b in range(256):
        os.makedirs(os.path.join(fp_dir, f"{b:02x}"), mode=0o700, exist_ok=True)
    tasks = [("fixed", 0, 0)] + [("chains", lo, min(lo + TASK_CHAINS, meta.chains))
                                 for lo in range(0, meta.chains, TASK_CHAINS)]
    t0 = last = time.monotonic()
    done = 0
    with multiprocessing.get_context("fork").Pool(meta.processes, _task_init, (meta,)) as workers:
        for n in workers.imap_unordered(_task, tasks):
            done += n
            now = time.monotonic()
            if now - last >= 2 or done == blocks:
                rate = done / max(now - t0, 1e-9)
                progress(f"  built {done:,}/{blocks:,} blocks  {rate:,.0f}/s  ETA {(blocks - done) / rate:,.0f} s")
                last = now
    if done != blocks:
        raise RuntimeError(f"scale_pool: wrote {done} blocks, planned {blocks}")
    meta.build_s = round(time.monotonic() - t0, 2)
    meta.build_rate = round(blocks / meta.build_s)
    _removal_plan(meta, pl)
    _save_meta(directory, meta)
    return meta


def _removal_plan(meta: PoolMeta, pl: Plan) -> None:
    """The age cutoff that expires about ``meta.target`` blocks, and the conversations restore() rewrites."""
    meta.target = min(meta.target, meta.blocks // 10)
    order = np.argsort(pl.recency_ns, kind="stable")
    covered = np.cumsum(pl.lengths[order])
    i = int(np.searchsorted(covered, meta.target))
    meta.expire_cutoff_ns = int(pl.recency_ns[order[i]]) + 1
    j = int(np.searchsorted(covered, RESTORE_FACTOR * meta.target)) + 1
    meta.old_chains = [int(c) for c in order[:j]]


def restore(meta: PoolMeta) -> int:
    """Write again the blocks of the oldest conversations that a benchmark removed; how many."""
    w = _Writer(meta)
    w.conversations(plan(meta.blocks, meta.seed, meta.built_ns), meta.old_chains, only_missing=True)
    return w.written


def settle(meta: PoolMeta) -> dict[str, float]:
    """Leave the pool as active writers leave it, every shard summary complete but stale: bring every
    summary up to date (a refresh without budgets, under the pool's eviction lock), then create and
    remove one name in every shard directory, as a writer's publication changes it.  A remover timed
    next pays what it pays in service (budgeted rebuilds, the count of stale shards) and still finds
    every block, restored ones included, in the summaries.  Returns the seconds of each step and the
    pool's usage and blocks as the summaries now count them exactly."""
    from gds_kv_connector.maintenance.eviction import EvictLock
    from gds_kv_connector.maintenance.recency import RecencyIndex
    from gds_kv_connector.maintenance.shard_summary import RootSummaries, fx_bytes, refresh

    t0 = time.monotonic()
    with EvictLock(meta.root) as lock:
        if not lock.acquire():
            raise RuntimeError(f"scale_pool: the eviction lock of {meta.root} is held")
        index = RecencyIndex(meta.root)
        index.set_horizon(0)
        sums = RootSummaries.load(meta.root, 0)
        refresh([sums], [index.refresh()], time.time(), write=True, budget=None)
    t1 = time.monotonic()
    for shard in sums.shards:
        path = os.path.join(shard.dir, ".settle")
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        os.unlink(path)
    return {"summaries_s": round(t1 - t0, 2), "touch_s": round(time.monotonic() - t1, 2),
            "usage_bytes": fx_bytes(sums.live_fx), "blocks": sums.live_count}


if __name__ == "__main__":
    sys.exit("scale_pool.py is a library of profiling/scale_bench.py: run that")
