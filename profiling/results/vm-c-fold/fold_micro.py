"""Recorded probe (not maintained): 64 decode reports folded back to back (save off), against reading their
fields alone; with MIB > 0, that much other memory is written before each fold, as a forward pass does.

    python fold_micro.py TREE [MIB]      # fold-back-to-back.log: MIB 0, 2000 folds; fold-after-32mib.log: MIB 32, 600
"""
import sys
import time

sys.path[:0] = [sys.argv[1]]
import torch  # noqa: E402
import gds_kv_connector.scheduler as S  # noqa: E402
from gds_kv_connector.trtllm_api import RequestData  # noqa: E402

mib = int(sys.argv[2]) if len(sys.argv) > 2 else 0
other = torch.zeros(mib << 18) if mib else None
print(S.__file__)
sched = S.GdsKvConnectorScheduler.__new__(S.GdsKvConnectorScheduler)
sched._reqs = {i: S._Request(i, b"s") for i in range(64)}
for st in sched._reqs.values():
    st.reported = True
    st.tokens = list(range(133))
sched._tpb, sched._save = 32, False


def reports(pos):
    return [RequestData(request_id=i, new_tokens=[7], new_block_ids=[], computed_position=pos, num_scheduled_tokens=1)
            for i in range(64)]


for name in ("fold", "read"):
    ts = []
    for r in range(600 if mib else 2000):
        reps = reports(r)
        if other is not None:
            other.add_(1.0)
        t0 = time.perf_counter_ns()
        if name == "fold":
            sched._fold_reports(reps, False, [])
        else:
            for rd in reps:
                rd.request_id, rd.new_tokens, rd.new_block_ids, rd.computed_position, rd.num_scheduled_tokens
        ts.append(time.perf_counter_ns() - t0)
        for st in sched._reqs.values():
            del st.tokens[133:]
    ts.sort()
    print(name, ts[0] / 1e3, ts[len(ts) // 2] / 1e3)
