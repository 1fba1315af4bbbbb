"""A fast CLI: only the commands that move KV (demo, bench) import torch; and ``gds-kv bench`` runs
where the package is installed, from any directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gds_kv_connector.cli.doctor import NVIDIA_DRIVER_PATHS
from tests.support import REPO

LIGHT = [["--help"], ["settings"], ["settings", "--check"], ["stats"], ["gc", "--dry-run"], ["verify"],
         ["metrics"], ["doctor"], ["demo", "--help"], ["metrics", "--help"]]


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory):
    """A pool with blocks, made in a child process (this one's settings stay as they are)."""
    root = tmp_path_factory.mktemp("startup") / "pool"
    code = ("from tests.support.connector_helpers import make_executor, rand_tokens, serve\n"
            "ex = make_executor(); serve(ex, [rand_tokens(200, 1)]); ex.worker.shutdown()\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(root), check=True, timeout=120)
    return root


def _env(root) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}, "TLLM_GDS_KV_ROOT": str(root)}


def _imported(argv: list[str], env: dict[str, str], cwd) -> tuple[int, set[str]]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gds_kv_connector.cli", *argv], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc.returncode, names


@pytest.mark.parametrize("argv", LIGHT, ids=" ".join)
def test_operator_commands_never_import_torch(small_pool, tmp_path, argv):
    if argv == ["doctor"] and any(map(os.path.exists, NVIDIA_DRIVER_PATHS)):
        pytest.skip("an NVIDIA driver is loaded: doctor asks torch about the GPU")
    code, names = _imported(argv, _env(small_pool), tmp_path)
    assert code == 0
    assert "gds_kv_connector.cli.main" in names and "torch" not in names


def test_bench_runs_from_outside_the_checkout(tmp_path):
    """``python -I``: no current directory or PYTHONPATH on the path, the package only as installed."""
    env = {k: v for k, v in _env(tmp_path).items() if k != "TLLM_GDS_KV_ROOT"}
    run = lambda *a: subprocess.run([sys.executable, "-I", "-m", "gds_kv_connector.cli", "bench", *a], cwd=tmp_path,
                                    env=env, capture_output=True, text=True, timeout=240)
    helped = run("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: gds-kv bench")
    ran = run("--quick", "--device", "cpu", "--targets", "shm", "--shm-dir", str(tmp_path / "shm"),
              "--no-baselines", "--no-executor", "--no-overlap", "--no-progress", "--no-drop-caches")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert [n for n in os.listdir(tmp_path) if n.startswith("gds-kv-bench-") and n.endswith(".json")]
