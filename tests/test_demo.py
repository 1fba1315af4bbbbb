import json
import subprocess
import sys


def test_demo_cli_restart_hits_and_verifies(tmp_path):
    out = tmp_path / "demo.json"
    res = subprocess.run([sys.executable, "-m", "gds_kv_connector.cli", "demo", "--root", str(tmp_path / "pool"),
                          "--device", "cpu", "--conversations", "4", "--rounds", "2", "--no-progress",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified byte-exact" in res.stdout and res.stdout.rstrip().endswith("OK")
    data = json.loads(out.read_text())
    restart = data["phases"][1]["rounds"][0]
    assert restart["hit_rate"] > 0.5 and data["ok"]


def test_cli_usage_errors_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("TLLM_GDS_KV_IO_THREADS", "0")
    res = subprocess.run([sys.executable, "-m", "gds_kv_connector.cli", "settings", "--check"],
                         capture_output=True, text=True, timeout=60,
                         env={"TLLM_GDS_KV_ROOT": str(tmp_path), "TLLM_GDS_KV_IO_THREADS": "0", "PATH": "/usr/bin"})
    assert res.returncode == 2 and "TLLM_GDS_KV_IO_THREADS" in res.stderr
