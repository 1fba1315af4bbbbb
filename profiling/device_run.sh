#!/bin/bash
# One device command that records a commit's GPU results: the GPU suite (doctor, gpu tests, six demos),
# a full bench on /dev/shm, a disk-arena bench, a small load timed under saves (load_under_saves.py)
# a cancelled 1 GiB load from disk (cancel_latency.py) and finished requests' page holding (save_release.py),
# each log and JSON under $OUT.  About 5 minutes on an H200
# host; each part has its own time limit, so one that hangs cannot take the others' time.
#
#   bash profiling/device_run.sh <commit>      (in the tree, with .whl/ and the built _native.abi3.so carried)
#
# Everything lands in $OUT/results.tgz (the device returns at most 8 files a call; a tarball keeps them all):
# unpack it into profiling/results/<gpu>-<commit>/ and commit it.
set -u
COMMIT=${1:?usage: device_run.sh <commit>}
DEST=${OUT:?OUT must name the folder the results go to}
OUT=/tmp/device-run
mkdir -p "$OUT"
trap 'tar czf "$DEST/results.tgz" -C "$OUT" .' EXIT
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>/dev/null || echo "wheels from .whl/ not installed: the bench runs without KvikIO"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$R GDS_KV_COMMIT=$COMMIT
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; date -u; lscpu | grep -E "Model name"; } > "$OUT/host.txt"
cat "$OUT/host.txt"

T0=$SECONDS
timeout 200 python profiling/gpu_suite.py --out /tmp/suite > /tmp/suite.log 2>&1
echo "suite rc $? in $((SECONDS - T0)) s"; tail -3 /tmp/suite.log
cp /tmp/suite/gpu-suite.json /tmp/suite/gpu-tests.log "$OUT/" 2>/dev/null
for f in /tmp/suite/demo-*.log; do echo "== $f"; tail -4 "$f"; done > "$OUT/demos-tail.log"
echo "demos OK: $(grep -c 'OK$' "$OUT/demos-tail.log")"

T0=$SECONDS
timeout 150 python -m gds_kv_connector.cli bench --budget-s 140 --targets shm --no-progress \
    --json "$OUT/bench-shm.json" --png "$OUT/bench-shm.png" > "$OUT/bench-shm.log" 2>&1
echo "shm bench rc $? in $((SECONDS - T0)) s"
grep -n "PASS\|MISS" "$OUT/bench-shm.log"

T0=$SECONDS
mkdir -p /tmp/benchpool
timeout 160 python -m gds_kv_connector.cli bench --targets disk --disk-pool arena --io-threads 4 --budget-s 150 \
    --no-baselines --no-executor --no-overlap --no-progress --disk-dir /tmp/benchpool \
    --json "$OUT/bench-disk.json" --png "$OUT/bench-disk.png" > "$OUT/bench-disk.log" 2>&1
echo "disk bench rc $? in $((SECONDS - T0)) s"
grep -n "PASS\|MISS" "$OUT/bench-disk.log"

T0=$SECONDS
mkdir -p /tmp/lus
for arena in 0 4GiB; do
  timeout 30 python profiling/load_under_saves.py --block 2MiB --loads 20 --io-threads 4 --save-threads 2 \
      --dir /tmp/lus --arena $arena --save-limit 12GiB >> "$OUT/load-under-saves.jsonl" 2>&1
done
echo "load under saves rc $? in $((SECONDS - T0)) s"; cat "$OUT/load-under-saves.jsonl"

T0=$SECONDS
mkdir -p /tmp/cancel
timeout 60 python profiling/cancel_latency.py --block 2MiB --blocks 512 --rounds 3 --cancel-after-ms 50 \
    --io-threads 4 --dir /tmp/cancel > "$OUT/cancel-latency.json" 2>&1
echo "cancel latency rc $? in $((SECONDS - T0)) s"; cat "$OUT/cancel-latency.json"

T0=$SECONDS
mkdir -p /tmp/release
timeout 90 python profiling/save_release.py --block 2MiB --requests 64 --blocks-per-request 4 --rounds 3 \
    --dir /tmp/release > "$OUT/save-release.json" 2>&1
echo "save release rc $? in $((SECONDS - T0)) s"; cat "$OUT/save-release.json"
