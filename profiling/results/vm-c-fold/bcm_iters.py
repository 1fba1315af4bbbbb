"""Recorded probe (not maintained): build_connector_meta's time per call in the bench's executor phase (6 runs, CPU pool), admission and decode iterations apart.  python bcm_iters.py TREE"""
import sys, os, time, tempfile, shutil, statistics, gc
tree=os.path.abspath(sys.argv[1]); sys.path[:0]=[os.path.join(tree,"profiling"), tree]
import torch, bench_executor
from bench_common import KvikioDefaults, Tracer
import gds_kv_connector.scheduler as S
assert S.__file__.startswith(tree)
gc.set_threshold(20000,10,10)
rec=[]
orig=S.GdsKvConnectorScheduler.build_connector_meta
def wrap(self, so):
    t0=time.perf_counter_ns(); r=orig(self, so); rec.append((len(so.new_requests), len(so.cached_requests), (time.perf_counter_ns()-t0)/1e3)); return r
S.GdsKvConnectorScheduler.build_connector_meta=wrap
adm=[];dec=[]
for _ in range(6):
    root=tempfile.mkdtemp(dir="/dev/shm")
    try: bench_executor.executor_cost(root, torch.device("cpu"), KvikioDefaults(), Tracer(None, False), arena_bytes=512<<20)
    finally: shutil.rmtree(root)
for n,c,t in rec:
    (adm if n else dec).append(t)
print(tree, "admission bcm median %.1f (n=%d)" % (statistics.median(adm), len(adm)), "decode bcm median %.1f p90 %.1f (n=%d)" % (statistics.median(dec), sorted(dec)[int(len(dec)*.9)], len(dec)))
