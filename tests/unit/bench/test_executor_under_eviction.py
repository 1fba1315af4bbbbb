"""profiling/executor_under_eviction.py runs end to end in its quick mode and reports its three phases.

Only that it runs: its timings are for the report (docs/performance.md), never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO

SCRIPT = os.path.join(REPO, "profiling", "executor_under_eviction.py")


@pytest.mark.timeout(120)
def test_the_quick_run_reports_every_phase(tmp_path):
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--json", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == result
    phases = result["phases"]
    assert list(phases) == ["none", "thread", "process"]
    for name, phase in phases.items():
        assert phase["calls"] > 0 and 0 < phase["p50_us"] <= phase["p99_us"] <= phase["max_us"], name
    for name in ("thread", "process"):
        assert set(phases[name]["ratio"]) >= {"p50_us", "p99_us", "calls_per_s"}
        (run,) = phases[name]["passes"]
        assert run["failed_runs"] == 0 and not run["skipped"]
        assert run["evicted_blocks"] > 0.9 * run["blocks"]  # the pass really freed the pool
