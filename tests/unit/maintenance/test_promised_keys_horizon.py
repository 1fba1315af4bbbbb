"""PromisedKeys, which the arena asks before taking back a slot, keeps in memory only the accesses within
the grace (less the horizon's slack), not every key the access logs ever named."""

import os
import time

from gds_kv_connector.maintenance.capacity import PromisedKeys
from gds_kv_connector.maintenance.recency import HORIZON_SLACK_NS, RecencyLog
from gds_kv_connector.maintenance.pool_scan import owners_dir

GRACE_S = 300.0


def test_only_accesses_within_the_grace_are_kept(tmp_path):
    root = str(tmp_path)
    os.makedirs(owners_dir(root))
    now = time.time_ns()
    old = [bytes([1, i]) * 16 for i in range(200)]
    recent = [bytes([2, i]) * 16 for i in range(3)]
    log = RecencyLog(root, "other-owner")
    log.touch(old, now_ns=now - 3 * 3600 * 10**9)
    log.touch(recent, now_ns=now - 10**9)
    log.flush()
    log.close()
    promised = PromisedKeys(lambda k: 0, [root], None, GRACE_S)
    assert promised(recent + old[:2]) == [True] * 3 + [False] * 2
    (index,) = promised._indexes
    assert index.horizon_ns >= now - int(GRACE_S * 1e9) - HORIZON_SLACK_NS - 10**9
    assert set(index.latest) == set(recent)  # the old records were neither kept nor needed
