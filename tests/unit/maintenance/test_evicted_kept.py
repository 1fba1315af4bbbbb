"""On a shared filesystem an evictor keeps what it removes out of the lookup path for EVICTED_KEEP_S.

Another node's client can still show a removed block's name from its caches, and its owner can promise the
block from that; the load then opens it in the fingerprint's ``evicted/`` directory instead of failing
the process.  A later run unlinks it once EVICTED_KEEP_S old.  The GlusterFS case runs in
tests/integration/test_shared_fs.py; here the evictor and the pool are told the root is shared.
"""

import os
import time

from gds_kv_connector.format.layout import EVICTED_KEEP_S, evicted_path
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
from gds_kv_connector.maintenance import eviction
from gds_kv_connector.maintenance.eviction import evict
from gds_kv_connector.store.pool import BlockPool

FP = bytes(range(32))
PAYLOAD = 4096
HOUR_AGO_NS = time.time_ns() - 3600 * 10**9


def _put(pool: BlockPool, i: int) -> bytes:
    k = bytes([i]) * 32
    fd, tmp = pool.create_tmp(k, BlockHeader(FP, k, PAYLOAD, 0, 1, 4, HOUR_AGO_NS, ZERO_KEY))
    os.pwrite(fd, bytes([i]) * PAYLOAD, 4096)
    assert pool.publish(fd, tmp, k)
    os.utime(pool.path_for(k), ns=(HOUR_AGO_NS, HOUR_AGO_NS))
    return k


def _pool(root: str, shared: bool) -> BlockPool:
    pool = BlockPool((root,), FP, PAYLOAD, 4, geometry_note="evicted")
    pool.keeps_evicted = shared
    return pool


def test_a_shared_root_keeps_evicted_blocks_until_they_are_old_enough(tmp_path, monkeypatch):
    monkeypatch.setattr(eviction, "is_shared_fs", lambda root: True)
    root = str(tmp_path)
    pool = _pool(root, True)
    keys = [_put(pool, i) for i in range(1, 5)]
    report = evict(root, 1, 0.5, 0, 1)
    assert report.evicted_blocks == 4
    for k in keys:
        assert not os.path.exists(pool.path_for(k))
        assert os.path.exists(evicted_path(pool.fp_dirs[0], k))
    reader = _pool(root, True)  # another owner that matched from a stale cache, now pinning
    pin = reader.pin(keys[0])
    assert os.pread(pin.fd, 1, 4096) == bytes([1])  # the block's own bytes
    reader.unpin(pin)
    assert evict(root, 1, 0.5, 0, 1).evicted_kept_removed == 0  # too young to go
    later = time.time() + EVICTED_KEEP_S + 1
    assert evict(root, 1, 0.5, 0, 1, now=later).evicted_kept_removed == 4
    assert not any(os.path.exists(evicted_path(pool.fp_dirs[0], k)) for k in keys)


def test_a_local_root_unlinks_at_once(tmp_path):
    root = str(tmp_path)
    pool = _pool(root, False)
    keys = [_put(pool, i) for i in range(1, 3)]
    assert evict(root, 1, 0.5, 0, 1).evicted_blocks == 2
    assert not any(os.path.exists(p) for k in keys for p in (pool.path_for(k), evicted_path(pool.fp_dirs[0], k)))
