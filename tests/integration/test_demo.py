import json
import os
import subprocess
import sys


def test_demo_cli_restart_hits_and_verifies(tmp_path):
    out = tmp_path / "demo.json"
    res = subprocess.run([sys.executable, "-m", "gds_kv_connector.cli.main", "demo", "--root", str(tmp_path / "pool"),
                          "--device", "cpu", "--conversations", "4", "--rounds", "2", "--no-progress",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified byte-exact" in res.stdout and res.stdout.rstrip().endswith("OK")
    data = json.loads(out.read_text())
    restart = data["phases"][1]["rounds"][0]
    assert restart["hit_rate"] > 0.5 and data["ok"]


def test_cli_usage_errors_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("TLLM_GDS_KV_IO_THREADS", "0")
    res = subprocess.run([sys.executable, "-m", "gds_kv_connector.cli.main", "settings", "--check"],
                         capture_output=True, text=True, timeout=60,
                         env={"TLLM_GDS_KV_ROOT": str(tmp_path), "TLLM_GDS_KV_IO_THREADS": "0", "PATH": "/usr/bin"})
    assert res.returncode == 2 and "TLLM_GDS_KV_IO_THREADS" in res.stderr


def test_operator_commands_on_a_demo_pool(tmp_path):
    pool = tmp_path / "pool"
    run = lambda *a: subprocess.run([sys.executable, "-m", "gds_kv_connector.cli.main", *a], capture_output=True,
                                    text=True, timeout=300)
    assert run("demo", "--root", str(pool), "--device", "cpu", "--conversations", "2", "--rounds", "2",
               "--no-progress").returncode == 0
    stats = json.loads(run("stats", "--root", str(pool), "--json").stdout)
    assert stats["blocks"] > 0 and stats["bytes"] > 0
    ver = run("verify", "--root", str(pool), "--json")
    assert ver.returncode == 0 and json.loads(ver.stdout)["bad"] == 0
    victim = sorted((pool / "gdskv-v1").rglob("*.blk"))[0]
    with open(victim, "r+b") as fh:
        fh.seek(4096 + 5)
        fh.write(b"\xff\xfe")
    bad = run("verify", "--root", str(pool), "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["bad"] == 1 and not victim.exists()
    before = sorted(p.name for p in (pool / "gdskv-v1").rglob("*.blk"))
    no_grace = {**os.environ, "TLLM_GDS_KV_EVICT_GRACE_S": "0"}  # the demo's blocks are seconds old
    dry = subprocess.run([sys.executable, "-m", "gds_kv_connector.cli.main", "gc", "--root", str(pool), "--quota", "1MiB",
                          "--dry-run", "--json"], capture_output=True, text=True, timeout=300, env=no_grace)
    assert json.loads(dry.stdout)["dry_run"] and json.loads(dry.stdout)["evicted_blocks"] > 0
    assert sorted(p.name for p in (pool / "gdskv-v1").rglob("*.blk")) == before  # nothing removed
    gc = run("gc", "--root", str(pool), "--quota", "1MiB", "--json")
    assert gc.returncode in (0, 1) and "exit_code" in json.loads(gc.stdout)
    doc = run("doctor", "--root", str(pool), "--json")
    assert doc.returncode == 0 and "verdict" in json.loads(doc.stdout)
