import os, sys, time, random, tempfile
sys.path.insert(0, "profiling")
import torch
from bench_executor import connector_env
from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.reference import SimRequest, fake_llm_args
from gds_kv_connector.keys import chain_from_tokens
root = tempfile.mkdtemp(dir="/dev/shm")
import gc; gc.set_threshold(20000, 10, 10)
N = 4000
def t(label, fn, args_list):
    t0 = time.perf_counter_ns()
    for a in args_list: fn(*a)
    print(f"{label:30s} {(time.perf_counter_ns()-t0)/len(args_list)/1e3:.2f} us")
with connector_env(root):
    a = fake_llm_args(32, model="x")
    w = GdsKvConnectorWorker(a); w.register_kv_caches(torch.zeros((8, 1, 2, 512)))
    s = GdsKvConnectorScheduler(a); s.wait_for_initialization()
    rng = random.Random(1)
    P = [[rng.randrange(32000) for _ in range(133)] for _ in range(N*3)]
    reqs = [SimRequest(i, p, tokens=list(p)) for i, p in enumerate(P)]
    t("full match", s.get_num_new_matched_tokens, [(r, 0) for r in reqs[:N]])
    t("get_tokens", lambda r: r.get_tokens(0), [(r,) for r in reqs[N:2*N]])
    t("_state", s._state, [(r,) for r in reqs[N:2*N]])
    seed = s._state(reqs[N]).seed
    t("chain 4", chain_from_tokens, [(seed, p, 0, 32, 4) for p in P[N:2*N]])
    keys = [chain_from_tokens(seed, p, 0, 32, 4) for p in P[2*N:]]
    pool = s._lookup_pools[0]
    t("count_present miss", pool.count_present, [(k, 0) for k in keys])
    t("_note_seen", s._note_seen, [(k,) for k in keys])
    w.shutdown()
