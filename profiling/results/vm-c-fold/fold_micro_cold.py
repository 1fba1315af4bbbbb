"""Recorded probe (not maintained): fold_micro.py with 32 MiB written before each fold, as a forward pass does.  python fold_micro_cold.py TREE"""
import sys, time, os, torch
other=torch.zeros(32<<18)
sys.path[:0]=[sys.argv[1]]
from gds_kv_connector.scheduler import _Request
from gds_kv_connector.trtllm_api import RequestData, SchedulerOutput
from gds_kv_connector import native
import gds_kv_connector.scheduler as S
print(S.__file__)
class Fake: pass
sched = S.GdsKvConnectorScheduler.__new__(S.GdsKvConnectorScheduler)
sched._reqs = {i: _Request(i, b"s") for i in range(64)}
for st in sched._reqs.values(): st.reported=True; st.tokens=list(range(133))
sched._tpb=32; sched._save=False
def mk(pos): return [RequestData(request_id=i, new_tokens=[7], new_block_ids=[], computed_position=pos, num_scheduled_tokens=1) for i in range(64)]
best={}
for name in ("fold","read"):
  ts=[]
  for r in range(600):
    reps=mk(r)
    other.add_(1.0)
    t0=time.perf_counter_ns()
    if name=="fold": sched._fold_reports(reps, False, [])
    else:
        for rd in reps: rd.request_id, rd.new_tokens, rd.new_block_ids, rd.computed_position, rd.num_scheduled_tokens
    ts.append(time.perf_counter_ns()-t0)
    for st in sched._reqs.values(): del st.tokens[133:]
  ts.sort(); print(name, ts[0]/1e3, ts[len(ts)//2]/1e3)
