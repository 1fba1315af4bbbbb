"""profiling/scale_bench.py on a pool of 10k blocks: the pool it builds is valid (verify, stats and a match
accept every block), each operation reports a time and a peak RSS, the removers free the target and the
builder puts their blocks back, and the strace pass counts file-system calls."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "profiling", "scale_bench.py")
BLOCKS = 10_000


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    proc = subprocess.run([sys.executable, BENCH, "--blocks", "10k", "--dir", str(tmp_path / "pools"),
                           "--json", str(out), "--cache", "warm", "--limit-s", "60", "--verify-limit-s", "60",
                           *args], capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())["sizes"][0]


@pytest.mark.timeout(200)
def test_every_operation_on_a_valid_pool(tmp_path):
    size = _bench(tmp_path, "--no-strace")
    runs = {r["op"]: r for r in size["runs"]}
    assert set(runs) == {"summaries", "stats", "gc_dry_run", "verify", "startup", "match", "gc_max_age", "gc_quota",
                         "evict"}
    assert runs["summaries"]["detail"]["names_listed"] >= BLOCKS and runs["summaries"]["detail"]["summaries_stale"] == 0
    for r in runs.values():
        assert "error" not in r, r
        assert not r["timed_out"] and r["seconds"] >= 0 and r["peak_rss_mb"] > 0
    assert runs["stats"]["detail"]["blocks"] == BLOCKS
    assert runs["verify"]["detail"]["ok"] == runs["verify"]["detail"]["checked"] == BLOCKS
    assert runs["match"]["detail"]["matched_blocks"] == 4096
    target = size["target"]
    assert runs["gc_dry_run"]["detail"]["evicted_blocks"] >= target
    removed = [runs[op]["detail"]["evicted_blocks"] for op in ("gc_max_age", "gc_quota", "evict")]
    assert all(target <= n <= 2 * target for n in removed), removed
    assert [r["blocks"] for r in size["restores"]] == removed  # every removed block written back


@pytest.mark.timeout(200)
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_strace_pass_counts_file_system_calls(tmp_path):
    size = _bench(tmp_path, "--ops", "stats,evict")
    traced = {r["op"]: r for r in size["runs"] if r["cache"] == "strace"}
    assert traced["stats"]["fs_calls"]["stat"] > 0
    # every block a pass removes is one unlink (on a local filesystem), whatever it does to choose them
    assert traced["evict"]["fs_calls"]["unlink"] >= traced["evict"]["detail"]["evicted_blocks"] > 0
    assert traced["stats"]["nfs_1ms_s"] == pytest.approx(traced["stats"]["fs_ops"] / 1000, abs=0.1)
    assert not os.path.exists(tmp_path / "pools" / "10k")  # not kept: removed once measured
