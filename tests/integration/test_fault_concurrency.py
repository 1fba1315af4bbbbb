"""Eight owner processes saving and loading overlapping prefixes in one pool at once.

Owners share blocks by content key, so they constantly race to publish the same key and read
blocks others just published.  link(2) publication must give exactly one winner per key (the
others count lost_race, never raise), every load must be byte-exact, and nothing published may be
lost.  Children are spawned (as TensorRT-LLM's MPI ranks would be separate processes) and run for
GDSKV_TEST_SOAK_S seconds (default 60) after all are ready (not a TLLM_GDS_KV_* name: the connector
rejects unknown variables of its own prefix, and spawned owners inherit the environment).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections import Counter

import pytest

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402
from gds_kv_connector.engines.posix import PosixEngine  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]
OWNERS = 8
SOAK_S = float(os.environ.get("GDSKV_TEST_SOAK_S", "60"))


@fh.timeout(SOAK_S + 90)
def test_concurrent_owners_overlapping_prefixes(tmp_path):
    ctx = mp.get_context("spawn")
    root = str(tmp_path / "pool")
    fh.make_pool(root)  # create the layout once, as the first owner would
    events = [ctx.Event() for _ in range(OWNERS)]
    results = [str(tmp_path / f"owner{i}.json") for i in range(OWNERS)]
    go = ctx.Event()
    procs = [ctx.Process(target=_owner, args=(root, i, SOAK_S, go, results[i], events[i]), daemon=True)
             for i in range(OWNERS)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        for e in events:
            assert e.wait(60), "an owner did not start within 60 s"
        go.set()  # all owners start together, after the slow spawn + import of torch
        for p in procs:
            p.join(SOAK_S + 30)
            assert not p.is_alive(), "an owner did not finish its soak in time"
            assert p.exitcode == 0, f"owner exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    wall = time.monotonic() - t0
    data = [json.load(open(r)) for r in results]
    errors = [e for d in data for e in d["errors"]]
    assert not errors, errors[:5]
    total = Counter()
    for d in data:
        total.update(d["counts"])
    won = Counter(k for d in data for k in d["won"])
    dupes = [k for k, n in won.items() if n > 1]
    assert not dupes, f"{len(dupes)} key(s) published by more than one owner"
    pool = fh.make_pool(root, index_ttl_s=0.0)
    files = fh.block_files(pool)
    on_disk = {os.path.basename(p)[:64] for p in files}
    assert set(won) == on_disk, "a published block is missing, or a file appeared that nobody published"
    for p in files:
        fh.verify_file(p)
    assert fh.tmp_files(pool) == []
    engine = PosixEngine(io_threads=2)
    kv = fh.make_kv(16)
    keys = [bytes.fromhex(k) for k in sorted(won)]
    for i in range(0, len(keys), 16):
        fh.load_and_compare(pool, engine, kv, keys[i:i + 16])
    engine.close()
    assert total["lost_race"] > 0, "owners never raced on a key: the workload does not test publication races"
    assert total["blocks_loaded"] > 0 and total["published"] == len(won)
    print(f"soak: {OWNERS} owners x {SOAK_S:.0f}s (wall {wall:.1f}s): {dict(total)}, files={len(files)}")
    fh.record("concurrency", trials=total["saves"] + total["loads"], injected=0, detected=0, lost=0,
              published=total["published"], lost_race=total["lost_race"], blocks_loaded=total["blocks_loaded"])


def _owner(root, idx, duration, go, result, ready):
    """Spawned owner: signal ready, wait for the common start, then run fault_helpers.soak_child."""
    from tests.support import fault_helpers as helpers
    ready.set()
    if not go.wait(90):
        raise SystemExit(3)
    helpers.soak_child(root, idx, duration, time.time(), result, go)
