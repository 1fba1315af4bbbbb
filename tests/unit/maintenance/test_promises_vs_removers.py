"""A block promised to a request stays on disk until its load pins it, whoever removes blocks: the
connector's own evictor, ``gds-kv gc`` in each of its modes (a dry run reporting the same), and an
owner whose grace is shorter than its index's trust window.

The owner is a real process: it looks the blocks up, promises them through its access log (the
flusher writes the promise), and loads them (opens every file) only when told to, after the
remover ran.  A removed block is its "file vanished".
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from gds_kv_connector.maintenance import eviction
from gds_kv_connector.maintenance.capacity import CapacityGuard
from gds_kv_connector.maintenance.operations import gc
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
from gds_kv_connector.maintenance.pool_scan import scan_pool
from gds_kv_connector.maintenance.recency import RecencyLog
from gds_kv_connector.config.settings import Settings

from tests.support import REPO
FP = b"\x5c" * 32
PAYLOAD = 4096
FILE = 8192
HOUR_AGO_NS = time.time_ns() - 3600 * 10**9

# The serving owner: match (a stat of every key), promise (its access log's flusher writes it at
# once), say so, wait to be told, then load: open every file, as a load pins it.
OWNER = r"""
import sys
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.maintenance.recency import RecencyLog
root, fp, keys = sys.argv[1], bytes.fromhex(sys.argv[2]), [bytes.fromhex(k) for k in sys.argv[3:]]
pool = BlockPool((root,), fp, 4096, 4)
assert pool.count_present(keys) == len(keys), "not all present at the match"
log = RecencyLog.for_process(root)
log.promise(keys)
log.flush()  # returns once the flusher's write of the promise is done
print("promised", flush=True)
sys.stdin.readline()
vanished = 0
for k in keys:
    try:
        pool.unpin(pool.pin(k))
    except FileNotFoundError:
        vanished += 1
print(f"loaded {len(keys) - vanished} vanished {vanished}", flush=True)
"""


def key(chain: int, i: int) -> bytes:
    return bytes([chain]) + i.to_bytes(31, "big")


def put_chain(pool: BlockPool, chain: int, n: int, created_ns: int) -> list[bytes]:
    """Publish a chain of ``n`` blocks created (header and mtime) at ``created_ns``."""
    keys = [key(chain, i) for i in range(n)]
    for k, parent in zip(keys, [ZERO_KEY] + keys[:-1]):
        fd, tmp = pool.create_tmp(k, BlockHeader(FP, k, PAYLOAD, 0, 1, 4, created_ns, parent))
        os.pwrite(fd, b"\x5a" * PAYLOAD, 4096)
        assert pool.publish(fd, tmp, k)
        os.utime(pool.path_for(k), ns=(created_ns, created_ns))
    return keys


def clean_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    return env | {f"TLLM_GDS_KV_{k.upper()}": v for k, v in settings.items()}


class Owner:
    """The owner process, from its promise to its load."""

    def __init__(self, root: str, keys: list[bytes]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", OWNER, root, FP.hex(), *(k.hex() for k in keys)],
                                     cwd=REPO, env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "promised"

    def load(self) -> tuple[int, int]:
        """(blocks loaded, blocks whose file vanished)."""
        out, _ = self.proc.communicate("load\n", timeout=30)
        words = out.split()
        return int(words[1]), int(words[3])


def present(root: str) -> set[bytes]:
    return {b.key for b in scan_pool(root).blocks}


def cli_gc(root: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "gds_kv_connector.cli.main", "gc", "--root", root, "--json", *args],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)


def own_evictor(root: str) -> dict:
    """Another owner's CapacityGuard, over quota, in a process of its own."""
    code = ("import sys, json\nfrom gds_kv_connector.maintenance.capacity import CapacityGuard\n"
            "g = CapacityGuard([sys.argv[1]], quota_bytes=1, low_watermark=0.5, min_free_bytes=0, grace_s=300)\n"
            "assert g.check_now(timeout=30)\ng.close()\nr = g.last_reports[0]\n"
            "print(json.dumps({'evicted_blocks': r.evicted_blocks, 'protected_blocks': r.protected_blocks}))")
    done = subprocess.run([sys.executable, "-c", code, root], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


PROMISE_AGE_S = 1.5  # how long the promise waits for its load when the remover runs: within the grace
REMOVERS = {  # each with the owners' settings (the default grace, 300 s)
    "gc --max-age-s": lambda root: cli_gc(root, "--max-age-s", "1"),
    "gc --max-age-s --dry-run": lambda root: cli_gc(root, "--max-age-s", "1", "--dry-run"),
    "gc --quota": lambda root: cli_gc(root, "--quota", "1"),
    "gc --quota --dry-run": lambda root: cli_gc(root, "--quota", "1", "--dry-run"),
    "gc --max-age-s --quota": lambda root: cli_gc(root, "--max-age-s", "1", "--quota", "1"),
    "the connector's evictor": own_evictor,
}


@pytest.mark.parametrize("remover", list(REMOVERS))
def test_a_promised_block_outlives_every_remover_until_its_load(tmp_path, remover):
    """Issue 38: ``gds-kv gc --max-age-s`` between a match and its load removed the promised blocks:
    the age asked is shorter than the promise has waited, the grace is not."""
    root = str(tmp_path)
    pool = BlockPool((root,), FP, PAYLOAD, 4, geometry_note="promises")
    cold = put_chain(pool, 0x01, 2, HOUR_AGO_NS - 10**9)  # nobody wants these: every remover may take them
    promised = put_chain(pool, 0x02, 4, HOUR_AGO_NS)  # an hour old, and promised just now
    owner = Owner(root, promised)
    time.sleep(PROMISE_AGE_S)
    result = REMOVERS[remover](root)
    loaded, vanished = owner.load()
    left = present(root)
    print(f"{remover}: removed {result['evicted_blocks']} (cold {len(cold)}), protected "
          f"{sum(r['protected_blocks'] for r in result.get('runs', [result]))}, loaded {loaded}, vanished {vanished}")
    assert (loaded, vanished) == (len(promised), 0)
    assert set(promised) <= left
    assert result["evicted_blocks"] == len(cold)  # the dry runs say what the real runs do
    assert left & set(cold) == (set(cold) if "dry-run" in remover else set())


def test_a_promise_written_while_gc_unlinks_keeps_its_blocks(tmp_path, monkeypatch):
    """gc planned on logs read before the owner promised, and unlinked afterwards: it reads them
    again while it unlinks.  The promise comes between gc's first unlink and its next ones."""
    root = str(tmp_path)
    pool = BlockPool((root,), FP, PAYLOAD, 4, geometry_note="promises")
    cold = put_chain(pool, 0x01, 2, HOUR_AGO_NS - 10**9)  # older: unlinked first
    promised = put_chain(pool, 0x02, 4, HOUR_AGO_NS)
    real_unlink = eviction._remove_if_same
    owners: list[Owner] = []

    def unlink_then_promise(block, ref, keep):
        done = real_unlink(block, ref, keep)
        if not owners:
            owners.append(Owner(root, promised))  # starts, matches and promises: over a second
        return done

    monkeypatch.setattr(eviction, "_remove_if_same", unlink_then_promise)
    result = gc(root, 0, 0.9, max_age_s=60)
    loaded, vanished = owners[0].load()
    print(f"gc removed {result['evicted_blocks']} of {len(cold) + len(promised)} planned; "
          f"loaded {loaded}, vanished {vanished}")
    assert (loaded, vanished) == (len(promised), 0)
    assert present(root) == set(promised) and result["evicted_blocks"] == len(cold)
    assert result["runs"][0]["protected_blocks"] >= 1


def test_an_owner_never_promises_from_its_index_a_block_its_evictor_removed(tmp_path):
    """Issue 38: with EVICT_GRACE_S below INDEX_TTL_S an owner evicted its own blocks and then
    promised them from its index.  Settings refuse that at start-up; the evictor is built here
    from settings that bypassed the check, and still keeps what the index trusts."""
    root = str(tmp_path)
    settings = dataclasses.replace(Settings.load_from({"TLLM_GDS_KV_ROOT": root}), quota_bytes=FILE,
                                   low_watermark=0.5, evict_grace_s=1.0, index_ttl_s=30.0)
    pool = BlockPool((root,), FP, PAYLOAD, 4, index_ttl_s=settings.index_ttl_s, geometry_note="index")
    keys = put_chain(pool, 0x03, 3, HOUR_AGO_NS)
    log = RecencyLog(root, "owner", flush_interval_s=0)
    guard = CapacityGuard.from_settings(settings, recency=log)
    try:
        assert pool.count_present(keys) == 3  # the match: stat'ed and indexed for 30 s
        log.promise(keys)
        log.flush()
        time.sleep(1.5)  # past the 1 s grace, well within the index's 30 s
        assert guard.check_now(timeout=30)
        evicted = guard.last_reports[0].evicted_blocks
        promised_again = pool.count_present(keys)  # from the index, no stat
        vanished = 0
        for k in keys[:promised_again]:
            try:
                pool.unpin(pool.pin(k))
            except FileNotFoundError:
                vanished += 1
    finally:
        guard.close()
        log.close()
    print(f"evictor removed {evicted}; index promised {promised_again} again, {vanished} vanished")
    assert promised_again == 3 and vanished == 0 and evicted == 0
    assert guard.grace_s >= settings.index_ttl_s
