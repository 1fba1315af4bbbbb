"""Recorded probe (not maintained): each callback's time in the admission iterations (1 and 17) and in the others, over five bench executor phases on a CPU pool.  python adm_split.py TREE"""
import sys, os, time, tempfile, shutil, statistics, gc, collections
tree=os.path.abspath(sys.argv[1]); sys.path[:0]=[os.path.join(tree,"profiling"), tree]
import torch, bench_executor
from bench_common import KvikioDefaults, Tracer
from gds_kv_connector.reference import executor as E
gc.set_threshold(20000,10,10)
it=[0]; rec=collections.defaultdict(lambda: collections.defaultdict(list))
orig_step=E.ReferenceExecutor.step
def step(self):
    it[0]+=1; self._cur=collections.defaultdict(float); orig_step(self)
    for k,v in self._cur.items(): rec[k][it[0]].append(v)
E.ReferenceExecutor.step=step
orig_t=E.ReferenceExecutor._timed
def timed(self, fn, *a, layer_hook=False):
    t0=time.perf_counter()
    try: return orig_t(self, fn, *a, layer_hook=layer_hook)
    finally:
        if hasattr(self,"_cur"): self._cur[fn.__name__]+= time.perf_counter()-t0
E.ReferenceExecutor._timed=timed
firsts=collections.defaultdict(list); rest=collections.defaultdict(list)
for _ in range(5):
    root=tempfile.mkdtemp(dir="/dev/shm"); it[0]=0; rec.clear()
    try: bench_executor.executor_cost(root, torch.device("cpu"), KvikioDefaults(), Tracer(None, False), arena_bytes=512<<20)
    finally: shutil.rmtree(root)
    # iterations 1 and 17 are admissions (two rounds of 16)
    for k,d in rec.items():
        for i,v in d.items():
            (firsts if i in (1,17) else rest)[k].append(sum(v)*1e6)
print(tree)
for k in sorted(set(firsts) | set(rest), key=lambda k: -statistics.median(firsts[k] or [0])):
    fm = statistics.median(firsts[k]) if firsts[k] else 0.0
    rm = statistics.median(rest[k]) if rest[k] else 0.0
    print(f"  {k:30s} admission median {fm:7.1f} us   other iterations median {rm:6.1f} us (n={len(rest[k])}; "
          f"sum over them per phase {sum(rest[k]) / 5:7.1f} us)")
