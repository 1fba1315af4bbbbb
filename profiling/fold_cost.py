"""The scheduler's per-request work run back to back, with and without other memory written between
folds: how much of the executor phase's figures is the callbacks' instructions and how much the memory
they touch.

    python profiling/fold_cost.py [--reps 300] [--touch-mib 0,4,32,128] [--eager]

Times, in executor-thread CPU (``time.thread_time_ns``), with a host-memory pool in a temporary
directory under /dev/shm (or the system temp directory): ``build_connector_meta`` folding 64 decode
reports (one new token each, no new pages, saves off as in 31 of 32 decode steps), back to back; and
admission, ``get_num_new_matched_tokens`` + ``update_state_after_alloc`` for 64 new 133-token
requests, cold (nothing in the pool: one ``lstat`` per request) and warm (every block indexed).
The bench's executor phase runs the same callbacks between the reference executor's forward passes
and measured them 2-3 times slower on the CI VM (``profiling/executor_split.py``).  ``--touch-mib``
repeats the fold with that much other memory written between folds, as a forward pass (or the
rest of TensorRT-LLM's iteration) does: if the fold slows as the cache is evicted, its cost is the
memory it reads (each request's report, state and token list), which fewer instructions would not
remove.  Beside each fold series, alternated with it, the time to read the same reports' fields and
nothing else: the floor under any fold, however its state is kept.  With the default way of saving
generated blocks (``TLLM_GDS_KV_SAVE_GENERATED=auto``: at the request's finish, one worker) decode reports
are not folded, so the fold series times that early return; ``--eager`` folds them as ``eager`` does.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_executor import cpu_connector, read_report_fields  # noqa: E402
from gds_kv_connector import GdsKvConnectorScheduler  # noqa: E402
from gds_kv_connector.reference import SimRequest  # noqa: E402
from gds_kv_connector.trtllm_api import RequestData, SchedulerOutput  # noqa: E402

REQUESTS, PROMPT, TPB = 64, 133, 32


def _prompts(rng: random.Random) -> list[SimRequest]:
    out = []
    for _ in range(REQUESTS):
        p = [rng.randrange(32000) for _ in range(PROMPT)]
        r = SimRequest(rng.randrange(1 << 40), p)
        r.tokens = list(p)
        out.append(r)
    return out


def _admit(sched: GdsKvConnectorScheduler, reqs: list[SimRequest]) -> float:
    """Microseconds of thread CPU to admit ``reqs`` (match, then allocation)."""
    pages = list(range(PROMPT // TPB + 1))
    t0 = time.thread_time_ns()
    for r in reqs:
        sched.get_num_new_matched_tokens(r, 0)
        sched.update_state_after_alloc(r, pages)
    return (time.thread_time_ns() - t0) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300, help="folds timed (admissions: a tenth of it)")
    ap.add_argument("--touch-mib", default="0", help="comma-separated MiB of other memory written between folds; "
                    "one fold series per value")
    ap.add_argument("--eager", action="store_true", help="fold every decode report, as SAVE_GENERATED=eager does")
    a = ap.parse_args()
    touch = [int(x) for x in a.touch_mib.split(",")]
    if any(t < 0 for t in touch):
        raise SystemExit("fold_cost.py: --touch-mib values must be 0 or more")
    rng = random.Random(1)
    with cpu_connector("fold-cost", TPB, 1024) as (sched, _):
        if a.eager:
            sched._fold_decode = True  # what TLLM_GDS_KV_SAVE_GENERATED=eager sets (the rig clears the variable)
        print(f"decode reports {'folded (eager)' if sched._fold_decode else 'not folded (saved at finish)'}")
        cold = [_admit(sched, _prompts(rng)) for _ in range(max(a.reps // 10, 3))]
        warm_reqs = _prompts(rng)
        for r in warm_reqs:  # every block marked present in the pool's index: the match's indexed path
            sched.get_num_new_matched_tokens(r, 0)
            sched._lookup_pools[0]._index.update(dict.fromkeys(sched._reqs.pop(r.request_id).keys,
                                                               time.monotonic() + 3600))
        warm = []
        for _ in range(max(a.reps // 10, 3)):
            for r in warm_reqs:
                sched._reqs.pop(r.request_id, None)
            warm.append(_admit(sched, warm_reqs))
        sched._out_loads.clear()

        sched._save = False  # the fold alone, as in the decode steps that complete no block
        ids = [r.request_id for r in warm_reqs]
        first = SchedulerOutput()
        first.new_requests = [RequestData(request_id=i, new_tokens=list(r.tokens), new_block_ids=[0, 1, 2, 3, 4],
                                          computed_position=0, num_scheduled_tokens=PROMPT)
                              for i, r in zip(ids, warm_reqs)]
        sched.build_connector_meta(first)
        folds: dict[int, list[float]] = {}
        floors: dict[int, list[float]] = {}
        pos = PROMPT
        for mib in touch:
            other = torch.zeros(mib << 18) if mib else None  # float32: 2**18 per MiB
            times, floor = folds[mib], floors[mib] = [], []
            for _ in range(a.reps):
                for into in (floor, times):  # alternated, so both see the same cache conditions
                    out = SchedulerOutput()
                    out.cached_requests = [RequestData(request_id=i, new_tokens=[7], new_block_ids=[],
                                                       computed_position=pos, num_scheduled_tokens=1)
                                           for i in ids]
                    if other is not None:
                        other.add_(1.0)
                    t0 = time.thread_time_ns()
                    if into is times:
                        sched.build_connector_meta(out)
                        pos += 1
                    else:
                        read_report_fields(out.cached_requests)
                    into.append((time.thread_time_ns() - t0) / 1e3)
    rows = [("admission of 64, cold (misses)", cold), ("admission of 64, warm (all indexed)", warm)]
    for mib in touch:
        rows += [(f"fold of 64 decode reports, {mib} MiB written between folds", folds[mib]),
                 (f"  reading those reports' fields alone (the floor of any fold), {mib} MiB", floors[mib])]
    for name, xs in rows:
        print(f"{name}: min {min(xs):.1f} us, median {statistics.median(xs):.1f} us "
              f"({min(xs) / REQUESTS:.2f} us per request at the min), {len(xs)} runs")


if __name__ == "__main__":
    main()
