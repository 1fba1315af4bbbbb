"""Files in the owners directory are anyone's to plant: a 2 GiB sparse access log, stats file,
archive or retired-owners record, and FIFOs under every name gc and the owners read.  Neither
``gds-kv gc`` nor a serving owner's evictor may read such a file whole (MemoryError, a GiB more
RSS) or block on a FIFO; the part of a log over the cap is counted and skipped.

Measured on real processes: the gc child's peak RSS comes from ``os.wait4`` (that child alone,
not the largest child this test run ever had), and a watchdog kills it if a FIFO hangs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from gds_kv_connector.maintenance import recency
from gds_kv_connector.maintenance.eviction import LOG_FOLD_AGE_S
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.util.host import HOST_TAG
from gds_kv_connector.format.records import ZERO_KEY, BlockHeader
from gds_kv_connector.maintenance.pool_scan import owners_dir, scan_pool
from gds_kv_connector.maintenance.recency import ARCHIVE_NAME, RECORD

from tests.support import REPO
FP = b"\x6d" * 32
PAYLOAD = 4096
GIB = 1 << 30
MIB = 1 << 20
TIMEOUT_S = 60  # a hang on a FIFO is for ever: anything that ends well within this did not hang
SPARSE = ("fresh-1.access", "idle-2.access", ARCHIVE_NAME, "big.1.stats.json", "retired-owners.json")
FIFOS = ("fifo-3.access", "stale-4.access", "fifo.5.stats.json", f"{HOST_TAG}-6-abcd0123.writer",
         "fifo-7.access.tmp-otherhost-7-abcd0123")
IDLE = ("idle-2.access", "stale-4.access", "fifo.5.stats.json", f"{HOST_TAG}-6-abcd0123.writer")

# A serving owner: its evictor's index reads every log, and the log it starts under (its owner id is
# host and pid: a restart may get the same) is already a 2 GiB sparse file, which it appends to and
# then compacts.  Prints how much its peak RSS grew.
OWNER = r"""
import json, os, sys
from gds_kv_connector.maintenance.pool_scan import owners_dir
from gds_kv_connector.maintenance.recency import RecencyIndex, RecencyLog
root = sys.argv[1]
own = os.path.join(owners_dir(root), "victim.access")
os.truncate(os.open(own, os.O_WRONLY | os.O_CREAT), 2 << 30)
def hwm_kib():  # this process's own peak (ru_maxrss carries a parent's across fork and exec)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
before = hwm_kib()
index = RecencyIndex(root)
index.refresh()
log = RecencyLog(root, "victim", flush_interval_s=0)
log.touch([b"\x02" * 32])
log.flush()  # appends after the 2 GiB, then compacts the log
index.refresh()
grew = hwm_kib() - before
print(json.dumps({"rss_growth_kib": grew, "skipped_bytes": index.skipped_bytes,
                  "log_bytes": os.path.getsize(own), "keys": sorted(k.hex()[:2] for k in index.latest)}))
"""


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}


# The child's own peak: VmHWM of its memory after exec.  ru_maxrss would not do: Linux carries the
# high-water mark across fork and exec, so a child of a large pytest process reports the parent's.
HWM = "VmHWM_kB="
_WITH_HWM = ("import atexit, runpy, sys\n"
             "def hwm():\n"
             "    for line in open('/proc/self/status'):\n"
             "        if line.startswith('VmHWM:'):\n"
             f"            print('\\n{HWM}' + line.split()[1], flush=True)\n"
             "atexit.register(hwm)\n"
             "sys.argv = sys.argv[1:]\n"
             "if sys.argv[0] == '-m':\n"
             "    sys.argv = sys.argv[1:]\n"
             "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
             "elif sys.argv[0] == '-c':\n"
             "    code = sys.argv[1]\n"
             "    sys.argv = ['-c', *sys.argv[2:]]\n"
             "    exec(compile(code, '<child>', 'exec'), {'__name__': '__main__'})\n")


def run_measured(args: list[str]) -> tuple[int, str, int, float]:
    """(exit status, output, peak RSS in bytes, seconds) of a child (``[python, -m|-c, ...]``), killed
    after TIMEOUT_S; its peak is its own VmHWM, printed by a wrapper as it exits."""
    t0 = time.monotonic()
    args = [args[0], "-c", _WITH_HWM, *args[1:]]
    proc = subprocess.Popen(args, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()))
    reader.start()
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        watchdog.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    reader.join()
    out, _, peak = chunks[0].decode().rpartition(HWM)
    return proc.returncode, out.rstrip("\n") + "\n", int(peak.strip() or 0) * 1024, time.monotonic() - t0


def make_pool(root: str) -> list[bytes]:
    """A few blocks an hour old: gc's expiry step has work, so it reads every access log."""
    pool = BlockPool((root,), FP, PAYLOAD, 4, geometry_note="bounded")
    keys = [bytes([0x6d]) + i.to_bytes(31, "big") for i in range(3)]
    old = time.time_ns() - 3600 * 10**9
    for k, parent in zip(keys, [ZERO_KEY] + keys[:-1]):
        fd, tmp = pool.create_tmp(k, BlockHeader(FP, k, PAYLOAD, 0, 1, 4, old, parent))
        os.pwrite(fd, b"\x5a" * PAYLOAD, 4096)
        assert pool.publish(fd, tmp, k)
        os.utime(pool.path_for(k), ns=(old, old))
    return keys


def plant(root: str) -> None:
    d = owners_dir(root)
    for name in SPARSE:
        with open(os.path.join(d, name), "wb") as fh:
            fh.truncate(2 * GIB)  # `truncate -s 2G`: no disk used, 2 GiB to read
    for name in FIFOS:
        os.mkfifo(os.path.join(d, name))
    week_ago = time.time() - 8 * 86_400
    assert 8 * 86_400 > LOG_FOLD_AGE_S
    for name in IDLE:  # old enough for a fold, a retirement, a mark's tidy-up
        os.utime(os.path.join(d, name), (week_ago, week_ago))


def gc_cmd(root: str) -> list[str]:
    return [sys.executable, "-m", "gds_kv_connector.cli.main", "gc", "--root", root, "--json", "--max-age-s", "60"]


def test_gc_reads_planted_sparse_files_and_fifos_in_bounded_memory(tmp_path):
    clean, planted = str(tmp_path / "clean"), str(tmp_path / "planted")
    make_pool(clean)
    make_pool(planted)
    plant(planted)
    _, _, baseline, _ = run_measured(gc_cmd(clean))
    status, out, peak, took = run_measured(gc_cmd(planted))
    print(f"gc over {len(SPARSE)} sparse 2 GiB files and {len(FIFOS)} FIFOs: exit {status} in {took:.1f} s, "
          f"peak RSS {peak / MIB:.0f} MiB (same gc on a clean pool {baseline / MIB:.0f} MiB)")
    assert status == 0 and took < TIMEOUT_S
    assert peak - baseline < 100 * MIB
    result = json.loads(out[out.index("{"):])
    skipped = sum(r["log_bytes_skipped"] for r in result["runs"])
    print(f"{skipped / GIB:.2f} GiB of logs skipped, {result['evicted_blocks']} blocks expired")
    assert result["evicted_blocks"] == 3 and scan_pool(planted).blocks == []
    # what is over the cap in each log the index reads: the fresh one, the idle one, the archive
    assert skipped == 3 * (2 * GIB // RECORD.size * RECORD.size - recency.MAX_READ_BYTES)
    left = set(os.listdir(owners_dir(planted)))
    assert "idle-2.access" not in left and "stale-4.access" not in left  # idle logs folded away
    assert os.path.getsize(os.path.join(owners_dir(planted), ARCHIVE_NAME)) < MIB  # rewritten from what was read


def test_a_serving_owner_reads_and_compacts_a_2gib_log_in_bounded_memory(tmp_path):
    root = str(tmp_path)
    make_pool(root)
    plant(root)
    status, out, peak, took = run_measured([sys.executable, "-c", OWNER, root])
    assert status == 0, out
    got = json.loads(out[out.index("{"):])
    print(f"owner: refresh over 3 sparse 2 GiB logs and its own 2 GiB log in {took:.1f} s, peak RSS "
          f"{peak / MIB:.0f} MiB, grew {got['rss_growth_kib'] / 1024:.0f} MiB; {got['skipped_bytes'] / GIB:.2f} GiB "
          f"skipped; its log compacted to {got['log_bytes']} bytes; {got['keys']} keys")
    assert got["rss_growth_kib"] * 1024 < 100 * MIB
    assert got["skipped_bytes"] > 0 and got["log_bytes"] < MIB and got["keys"] == ["02"]
