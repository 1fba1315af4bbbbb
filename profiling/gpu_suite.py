"""Run the whole GPU suite in one command and write a JSON summary (used on the H200).

    python profiling/gpu_suite.py --out DIR

Runs `gds-kv doctor`, the `gpu`-marked tests (pytest, junit XML), and the demo on the GPU four
times (KVIKIO_COMPAT_MODE=ON: without GDS, files moved by the staged O_DIRECT path, then by
KvikIO's POSIX path with TLLM_GDS_KV_COMPAT_IO=kvikio; OFF: the cuFile path, or the engine's
start-up fallback with its reason where cuFile refuses the file; AUTO), plus with the slot arena
(TLLM_GDS_KV_ARENA_BYTES) on a /dev/shm pool (mapped slabs) and on the disk pool (slabs moved by
O_DIRECT), and writes
DIR/gpu-suite.json with the commit, pass/fail counts, the data path each run reported and the
demo figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(cmd: list[str], log: str, env: dict | None = None, timeout: int = 400) -> int:
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"[{time.time() - t0:6.1f}s] rc={rc} {' '.join(cmd)}", flush=True)
    return rc


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--pool", default="/tmp/gdskv-gpu-suite")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    summary: dict = {"commit": os.environ.get("GDS_KV_COMMIT") or commit(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    sh([py, "-m", "gds_kv_connector.cli", "doctor", "--root", args.pool, "--json"], f"{args.out}/doctor.json")
    junit = f"{args.out}/gpu-tests.xml"
    rc = sh([py, "-m", "pytest", "-q", "-m", "gpu", "-rA", "-s", f"--junitxml={junit}", "tests/gpu"],
            f"{args.out}/gpu-tests.log")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            kids = {c.tag for c in case}
            key = "failed" if "failure" in kids else "errors" if "error" in kids else \
                "skipped" if "skipped" in kids else "passed"
            counts[key] += 1
    summary["gpu_tests"] = {"rc": rc, **counts}
    demos = {}
    runs = [("staged", {"KVIKIO_COMPAT_MODE": "ON"}, f"{args.pool}-staged"),
            ("kvikio-posix", {"KVIKIO_COMPAT_MODE": "ON", "TLLM_GDS_KV_COMPAT_IO": "kvikio"},
             f"{args.pool}-kvikio-posix"),
            ("cufile-off", {"KVIKIO_COMPAT_MODE": "OFF"}, f"{args.pool}-cufile-off"),
            ("auto", {"KVIKIO_COMPAT_MODE": "AUTO"}, f"{args.pool}-auto"),
            ("disk-arena", {"KVIKIO_COMPAT_MODE": "AUTO", "TLLM_GDS_KV_ARENA_BYTES": "512MiB"},
             f"{args.pool}-disk-arena")]
    if os.path.isdir("/dev/shm"):  # the slot arena: 2 owner processes, then a restart that adopts their slabs
        runs.append(("arena", {"KVIKIO_COMPAT_MODE": "AUTO", "TLLM_GDS_KV_ARENA_BYTES": "512MiB"},
                     f"/dev/shm/gdskv-suite-arena-{os.getpid()}"))
    for name, env, pool in runs:
        subprocess.run(["rm", "-rf", pool])
        out = f"{args.out}/demo-{name}.json"
        drc = sh([py, "-m", "gds_kv_connector.cli", "demo", "--device", "cuda", "--root", pool, "--no-progress",
                  "--json", out], f"{args.out}/demo-{name}.log", env=env)
        if pool.startswith("/dev/shm/"):
            subprocess.run(["rm", "-rf", pool])
        d = json.load(open(out)) if os.path.exists(out) else {}
        demos[name] = {"rc": drc, "ok": d.get("ok", False),
                       "data_path": [p["data_path"] for p in d.get("phases", [])],
                       "rounds": [[{k: r[k] for k in ("round", "hit_rate", "loaded_tokens", "computed_tokens",
                                                      "bytes_loaded", "bytes_saved", "wall_s")}
                                   for r in p["rounds"]] for p in d.get("phases", [])]}
    summary["demo"] = demos
    summary["passed"] = rc == 0 and counts["failed"] == 0 and counts["errors"] == 0 and \
        all(d["ok"] for d in demos.values())
    with open(f"{args.out}/gpu-suite.json", "w") as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps(summary, indent=1))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
