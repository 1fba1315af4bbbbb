"""Where the executor thread's connector time goes, callback by callback and iteration by iteration.

    python profiling/executor_split.py [--device cuda] [--requests 64] [--layers 32]

Runs the bench's executor phase (``bench.executor_cost``: the reference executor, a cold round that
only saves, then a warm round that loads the same prompts) and splits each round into its first
iteration, which admits every request, and the steady ones after it: the first iteration's time per
callback, each callback's median over the steady iterations, and the costliest steady iteration
(where the requests finish), in microseconds.  The bench's
average per iteration mixes the two; this shows which one a change moved.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402
from gds_kv_connector.reference import ReferenceExecutor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    gc.set_threshold(20000, 10, 10)  # TensorRT-LLM's executor setting, as in the bench
    acc_of: dict[str, dict] = {}
    instrument = bench._instrument

    def keep_acc(obj, names, acc):
        acc_of["acc"] = acc
        return instrument(obj, names, acc)

    bench._instrument = keep_acc
    per_iter: list[dict[str, float]] = []
    step = ReferenceExecutor.step

    def timed_step(self):
        acc = acc_of.get("acc", {})
        before = {k: v[1] for k, v in acc.items()}
        step(self)
        per_iter.append({k: v[1] - before.get(k, 0.0) for k, v in acc.items()})

    ReferenceExecutor.step = timed_step
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="gdskv-split-", dir=base)
    try:
        out = bench.executor_cost(root, torch.device(args.device), bench.KvikioDefaults(), bench.Tracer(None, False),
                                  requests=args.requests, layers=args.layers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in out["rounds"]:
        print(f"{r['what']}: {r['callback_us_per_iteration']} us/iteration, {r['iteration_us']}")
    n = len(per_iter) // len(out["rounds"])
    for rnd in range(len(out["rounds"])):
        its = per_iter[rnd * n:(rnd + 1) * n]
        first = {k: round(v * 1e6) for k, v in sorted(its[0].items(), key=lambda kv: -kv[1])}
        print(f"round {rnd}: first iteration us {first}")
        names = set().union(*its[1:]) if len(its) > 1 else set()
        med = {k: statistics.median([it.get(k, 0.0) for it in its[1:]]) * 1e6 for k in names}
        print(f"round {rnd}: steady median us {({k: round(v, 1) for k, v in sorted(med.items(), key=lambda kv: -kv[1])})}")
        if len(its) > 1:  # the costliest steady iteration: where the requests finish
            worst = max(range(1, len(its)), key=lambda i: sum(its[i].values()))
            top = {k: round(v * 1e6) for k, v in sorted(its[worst].items(), key=lambda kv: -kv[1]) if v * 1e6 >= 1}
            print(f"round {rnd}: costliest steady iteration ({worst} of {len(its)}) us {top}")


if __name__ == "__main__":
    main()
