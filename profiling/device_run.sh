#!/bin/bash
# One device command that records a commit's GPU results: the GPU suite (doctor, gpu tests, six demos),
# a full bench on /dev/shm and a disk-arena bench, each log and JSON under $OUT.  About 5 minutes;
# each part has its own time limit, so one that hangs cannot take the others' time.
#
#   bash profiling/device_run.sh <commit>      (in the tree, with .whl/ and the built _native.abi3.so carried)
#
# Everything lands in $OUT/results.tgz (the device returns at most 8 files a call; a tarball keeps them all):
# unpack it into profiling/results/<gpu kind>/ in place of the set there, and commit it.
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
