"""Eviction (``gds-kv gc`` and every owner's CapacityGuard) on an arena pool: a save batch publishes
ONE reference file hard-linked under every key of the batch, and names slots whose headers hold the
blocks' creation times and parents (docs/format.md, "Arena")."""

from __future__ import annotations

import os
import time

from tests.unit.store.test_arena import _data, _flip, _keys, _pool, engine, shm_root, slab_mode  # noqa: F401 (fixtures)
from tests.unit.maintenance.test_eviction import record_calls, touch

from gds_kv_connector.maintenance import eviction
from gds_kv_connector.store.base import open_store
from gds_kv_connector.maintenance.eviction import evict
from gds_kv_connector.maintenance.operations import gc, stats
from gds_kv_connector.format.records import REF_ENTRY_SIZE, REF_HEADER_SIZE, ZERO_KEY
from gds_kv_connector.maintenance.pool_scan import scan_pool

T0 = time.time_ns() + 10 * 10**9  # touches after every slot header's created_ns
LATER = T0 / 1e9 + 10_000  # "now" for eviction runs: everything is old unless touched within the grace


def _ref_size(n: int) -> int:
    return REF_HEADER_SIZE + n * REF_ENTRY_SIZE


def _save_chain(pool, engine, keys: list[bytes], first_parent: bytes = ZERO_KEY, seed: int = 1) -> None:
    """One save batch of a chain: ``keys[i]``'s parent is ``keys[i-1]``; one reference file."""
    d = _data(len(keys), seed)
    out = open_store(pool, engine).save(keys, [first_parent] + keys[:-1], [d[i] for i in range(len(keys))])
    assert (out.published, out.arena_fallback) == (len(keys), 0)
    assert len({os.stat(pool.path_for(k)).st_ino for k in keys}) == 1


def _present(pool, keys: list[bytes]) -> list[int]:
    return [i for i, k in enumerate(keys) if os.path.exists(pool.path_for(k))]


# -- 1. bytes: a reference file counts once, however many keys it is linked under -----------------
def test_a_reference_file_counts_once_in_scans_stats_and_eviction(shm_root, engine):
    a = _pool(shm_root, engine, 2, per_slab=2)
    keys = _keys(3, b"mixed")
    d = _data(3, 2)
    out = open_store(a, engine).save(keys, [ZERO_KEY] * 3, [d[i] for i in range(3)])
    assert (out.published, out.arena_fallback) == (3, 1)  # two slots, then one block file
    ref = _ref_size(2)
    scan = scan_pool(shm_root)
    assert len(scan.blocks) == 3
    assert scan.block_bytes == ref + a.file_size
    assert scan.bytes_by_fp() == {scan.blocks[0].fp: ref + a.file_size}
    st = stats(shm_root)
    assert st["bytes"] == ref + a.file_size
    assert [e["bytes"] for e in st["fingerprints"].values()] == [ref + a.file_size]  # per fingerprint too
    # everything must go (quota 1 byte): the reference's bytes are freed once, with its last name
    rep = evict(shm_root, quota_bytes=1, low_watermark=0.5, min_free_bytes=0, grace_s=0, now=LATER, dry_run=True)
    assert rep.scanned_bytes == ref + a.file_size and rep.target_bytes == ref + a.file_size
    assert (rep.evicted_blocks, rep.evicted_bytes, rep.usage_after) == (3, ref + a.file_size, 0)
    a.arena.close()


def test_a_reference_s_bytes_are_freed_only_with_its_last_name(shm_root, engine):
    a = _pool(shm_root, engine, 16, per_slab=16)
    old, new = _keys(4, b"old"), _keys(4, b"new")
    _save_chain(a, engine, old)
    _save_chain(a, engine, new, seed=3)
    touch(shm_root, {**{k: T0 for k in old}, **{k: T0 + 10**9 for k in new}})
    ref = _ref_size(4)
    # over quota by one byte: one whole reference file (all four names of the older batch) must go
    rep = evict(shm_root, quota_bytes=2 * ref - 1, low_watermark=0.99, min_free_bytes=0, grace_s=0, now=LATER)
    assert rep.scanned_bytes == 2 * ref and rep.reached_target
    assert (rep.evicted_blocks, rep.evicted_bytes, rep.failed) == (4, ref, 0)
    assert _present(a, old) == [] and _present(a, new) == [0, 1, 2, 3]
    a.arena.close()


# -- 2. unlinking one name of a reference file does not make its other names look replaced ---------
def test_every_name_of_a_reference_file_can_be_evicted_in_one_run(shm_root, engine):
    a = _pool(shm_root, engine, 16, per_slab=16)
    keys = _keys(8, b"batch")
    _save_chain(a, engine, keys)
    r = gc(shm_root, quota_bytes=1, low_watermark=0.5, grace_s=0, now=LATER)
    run = r["runs"][-1]
    assert (r["evicted_blocks"], run["failed"], r["within_budget"], r["exit_code"]) == (8, 0, True, 0)
    assert _present(a, keys) == [] and r["usage_after"] == 0
    a.arena.close()


def test_a_name_republished_since_the_scan_is_not_evicted(shm_root, engine, monkeypatch):
    a = _pool(shm_root, engine, 16, per_slab=16)
    keys, d = _keys(4, b"re"), _data(5, 6)
    assert open_store(a, engine).save(keys, [ZERO_KEY] * 4, [d[i] for i in range(4)]).published == 4  # one file
    real_pull = eviction._Planner._pull

    def read_then_replace(planner, want):
        real_pull(planner, want)  # the run reads its window's names
        os.unlink(a.path_for(keys[1]))  # evicted by its owner and saved again since the run read it
        a.forget(keys[1])
        assert open_store(a, engine).save(keys[1:2], [ZERO_KEY], [d[4]]).published == 1
    monkeypatch.setattr(eviction._Planner, "_pull", read_then_replace)
    rep = evict(shm_root, quota_bytes=1, low_watermark=0.5, min_free_bytes=0, grace_s=0, now=LATER)
    assert rep.failed == 1 and _present(a, keys) == [1]  # the other names of the scanned file all went
    a.arena.close()


# -- 3. chain order: a reference's block has the parent its slot header names ----------------------
def test_chain_tails_go_before_heads_across_reference_files(shm_root, engine):
    a = _pool(shm_root, engine, 16, per_slab=16)
    chain = _keys(8, b"chain")
    _save_chain(a, engine, chain[:4])  # one reference file for the head half,
    _save_chain(a, engine, chain[4:], first_parent=chain[3], seed=4)  # one for the tail half
    # the head was used longest ago: plain LRU would take the head half first and cut the chain off
    touch(shm_root, {k: T0 + i * 10**9 for i, k in enumerate(chain)})
    ref = _ref_size(4)
    rep = evict(shm_root, quota_bytes=2 * ref - 1, low_watermark=0.99, min_free_bytes=0, grace_s=0, now=LATER)
    assert _present(a, chain) == [0, 1, 2, 3]  # the tail half went; the head still leads to the rest
    assert rep.unreadable_headers == 0 and (rep.evicted_blocks, rep.evicted_bytes, rep.failed) == (4, ref, 0)
    a.arena.close()


def test_reference_headers_are_read_once_per_file_and_cached_across_sibling_evictions(shm_root, engine,
                                                                                       monkeypatch):
    a = _pool(shm_root, engine, 16, per_slab=16)
    head, tail = _keys(4, b"head"), _keys(4, b"tail")
    _save_chain(a, engine, head)
    _save_chain(a, engine, tail, first_parent=head[3], seed=5)
    reads = record_calls(monkeypatch, "read_published")
    cache: eviction.HeaderCache = {}
    ref = _ref_size(4)
    rep = evict(shm_root, quota_bytes=2 * ref - 1, low_watermark=0.99, min_free_bytes=0, grace_s=0, now=LATER,
                header_cache=cache)
    assert (rep.evicted_blocks, rep.unreadable_headers) == (4, 0) and _present(a, head) == [0, 1, 2, 3]
    assert len(reads) == 2  # one read per reference file, not one per key
    assert [cache[a.path_for(k)][2] for k in head] == [ZERO_KEY] + head[:3]  # parents from the slot headers
    os.unlink(a.path_for(head[3]))  # another key of the batch goes: the ctime of every name changes
    reads.clear()
    rep = evict(shm_root, quota_bytes=1, low_watermark=0.5, min_free_bytes=0, grace_s=0, now=LATER,
                header_cache=cache)
    assert (rep.evicted_blocks, rep.failed) == (3, 0) and reads == []  # the cache still knows the other names
    a.arena.close()


def test_a_damaged_slot_header_makes_only_its_key_unreadable(shm_root, engine):
    a = _pool(shm_root, engine, 16, per_slab=16)
    keys = _keys(4, b"dmg")
    _save_chain(a, engine, keys)
    _flip(a.arena, a.arena.cached_ref(keys[2]), 0)  # the slot's magic
    rep = evict(shm_root, quota_bytes=1, low_watermark=0.5, min_free_bytes=0, grace_s=0, now=LATER, dry_run=True)
    assert rep.unreadable_headers == 1 and rep.evicted_blocks == 4
    a.arena.close()


def test_short_of_free_space_alone_an_arena_keeps_its_references(shm_root, engine):
    """A reference name holds an arena slot, preallocated: removing it frees no disk.  A root short
    of free space (TLLM_GDS_KV_MIN_FREE_BYTES) with no quota over used to lose every reference,
    emptying the cache for nothing; block files (arena fallbacks) still go."""
    a = _pool(shm_root, engine, 2, per_slab=2)
    keys = _keys(3, b"space")
    d = _data(3, 3)
    out = open_store(a, engine).save(keys, [ZERO_KEY] * 3, [d[i] for i in range(3)])
    assert (out.published, out.arena_fallback) == (3, 1)
    huge = 1 << 62  # more free space than any filesystem has: the root is always short
    rep = evict(shm_root, quota_bytes=0, low_watermark=0.9, min_free_bytes=huge, grace_s=0, now=LATER)
    assert rep.reason == "min_free" and rep.evicted_blocks == 1 and rep.evicted_bytes == a.file_size
    assert len(scan_pool(shm_root).blocks) == 2  # the two references stay
    a.arena.close()


def test_over_quota_and_short_of_space_references_go_only_for_the_quota(shm_root, engine):
    """Over quota by a byte while also short of free space: the run took the free-space target and
    removed every reference chasing it, though only the quota's one reference file had to go."""
    a = _pool(shm_root, engine, 32, per_slab=32)
    for i in range(4):
        keys = _keys(4, b"b%d" % i)
        d = _data(4, i + 1)
        out = open_store(a, engine).save(keys, [ZERO_KEY] + keys[:-1], [d[j] for j in range(4)])
        assert (out.published, out.arena_fallback) == (4, 0)
    usage = scan_pool(shm_root).block_bytes
    assert usage == 4 * _ref_size(4)
    rep = evict(shm_root, quota_bytes=usage - 1, low_watermark=0.99, min_free_bytes=1 << 62, grace_s=0, now=LATER)
    assert rep.reason == "quota+min_free"
    assert (rep.evicted_blocks, rep.evicted_bytes) == (4, _ref_size(4))  # one reference file's names
    assert len(scan_pool(shm_root).blocks) == 12
    a.arena.close()


# -- 5. promises: the arena taking back its own slots keeps what any owner promised ------------------
def test_a_full_arena_keeps_blocks_another_owner_promised(shm_root, engine):
    """Owner a's arena is full; owner b matched two of a's blocks (its promise is a record in its own
    access log).  When a needs slots, it evicts its least recently used blocks but none b promised:
    b's load still finds them, where it used to fail (fatal to b's process)."""
    from gds_kv_connector.maintenance.capacity import PromisedKeys
    from gds_kv_connector.maintenance.recency import RecencyLog
    from tests.unit.store.test_arena import _load

    a = _pool(shm_root, engine, 4, per_slab=4)
    old = _keys(4, b"promised-old")
    d = _data(4, 7)
    assert open_store(a, engine).save(old, [ZERO_KEY] * 4, [d[i] for i in range(4)]).published == 4
    b_log = RecencyLog((shm_root,), owner_id="owner-b")
    b_log.promise(old[:2])  # b matched the two least recently used blocks
    b_log.flush()
    a.arena.promised = PromisedKeys(a.root_of, a.roots, None, grace_s=60.0)
    new = _keys(2, b"needs-slots")
    out = open_store(a, engine).save(new, [ZERO_KEY] * 2, [_data(2, 8)[i] for i in range(2)])
    assert out.published == 2
    usage = a.arena.usage()
    print(f"evicted {usage['evicted']}, skipped as promised {a.arena.stats['evict_skipped_promised']}")
    assert a.arena.stats["evict_skipped_promised"] >= 2
    for k in old[:2]:
        a.forget(k)
        assert a.contains(k), "a promised block was evicted"
    assert (_load(a, engine, old[:2]) == d[:2]).all()  # what b's load reads
    b_log.close()
    a.arena.close()
