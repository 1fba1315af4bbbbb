"""What ``gds-kv`` writes: nothing after its reader went away (``| head``), progress bars on a
terminal only, and a demo that names its first phase by the pool it met."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "gds_kv_connector.cli"]


@pytest.fixture
def env(tmp_path):
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")},
            "TLLM_GDS_KV_ROOT": str(tmp_path / "pool")}


@pytest.fixture
def pool(pool_env):
    """A small pool with blocks (a reference executor served one prompt twice)."""
    from tests.support.connector_helpers import make_executor, rand_tokens, serve

    ex = make_executor()
    prompt = rand_tokens(300, 5)
    serve(ex, [prompt])
    serve(ex, [prompt], first_id=1)
    ex.worker.shutdown()
    return pool_env


@pytest.mark.parametrize("argv", [["settings"], ["settings", "--json"]])
def test_a_closed_pipe_ends_quietly(env, argv):
    """Its reader gone before the first byte: no "Broken pipe", no traceback, SIGPIPE's exit status."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([*CLI, *argv], env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_stats_into_head_ends_quietly(pool):
    cmd = " ".join([sys.executable, "-m", "gds_kv_connector.cli"])
    for sub in ("stats", "metrics", "settings"):
        proc = subprocess.run(f"{cmd} {sub} --root {pool} 2>&1 | head -1" if sub != "settings" else
                              f"{cmd} {sub} 2>&1 | head -1", shell=True, capture_output=True, text=True, timeout=60)
        assert proc.stdout.count("\n") == 1 and "Broken pipe" not in proc.stdout and "Traceback" not in proc.stdout


def test_verify_draws_no_progress_bar_into_a_file(pool, tmp_path):
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.run([*CLI, "verify", "--root", str(pool)], stdout=log, stderr=subprocess.STDOUT, timeout=60)
    text = (tmp_path / "log").read_text()
    assert proc.returncode == 0 and "\r" not in text and "blocks checked" in text


def test_the_demo_draws_its_bars_on_a_terminal_only(monkeypatch):
    from gds_kv_connector.cli import demo

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert demo._progress_bar(4, "phase1", True).disable
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert not demo._progress_bar(4, "phase1", True).disable
    assert demo._progress_bar(4, "phase1", False).disable  # --no-progress


def test_phase_one_is_named_by_the_pool_it_met():
    from gds_kv_connector.cli.demo import phase1_name

    cold = [{"rounds": [{"loaded_tokens": 0}, {"loaded_tokens": 64}]}, {"rounds": [{"loaded_tokens": 0}]}]
    warm = [{"rounds": [{"loaded_tokens": 0}]}, {"rounds": [{"loaded_tokens": 480}]}]
    assert phase1_name(cold) == "phase 1: cold pool"
    assert phase1_name(warm).startswith("phase 1: warm pool")


@pytest.mark.timeout(240)
def test_a_second_demo_run_meets_a_warm_pool(env, tmp_path):
    argv = [*CLI, "demo", "--device", "cpu", "--owners", "1", "--conversations", "2", "--rounds", "1"]
    first, second = (subprocess.run(argv, env=env, capture_output=True, text=True, timeout=110) for _ in range(2))
    assert first.returncode == 0 and "== phase 1: cold pool" in first.stdout, first.stdout + first.stderr
    assert second.returncode == 0 and "== phase 1: warm pool" in second.stdout, second.stdout + second.stderr
    assert "\r" not in first.stderr + second.stderr  # not a terminal: no bars
