"""Where the executor thread's connector time goes, callback by callback and iteration by iteration.

    python profiling/executor_split.py [--device cuda] [--requests 64] [--layers 32] [--new-tokens 16]

Runs the bench's executor phase (``bench_executor.executor_cost``: the reference executor, a cold round that
only saves, then a warm round that loads the same prompts) and splits each round into its first
iteration, which admits every request, and the steady ones after it: the first iteration's time per
callback, each callback's median over the steady iterations, and the costliest steady iteration
(where the requests finish), in microseconds.  The bench's
average per iteration mixes the two; this shows which one a change moved.  Each round also
prints the executor thread's CPU time in the callbacks (``time.thread_time``) beside their wall
time: the difference is time the thread waited, for the GIL (held by transfer threads), a lock, or
(the warm round's first layer hook) synchronous loads' bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_executor  # noqa: E402
from bench_common import KvikioDefaults, Tracer  # noqa: E402
from thread_clock import clock_bias  # noqa: E402
from gds_kv_connector.reference import ReferenceExecutor  # noqa: E402


_LAYER_HOOKS = ("save_kv_layer", "wait_for_layer_load")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens each request generates (the bench's "
                    "--exec-new-tokens)")
    args = ap.parse_args()
    gc.set_threshold(20000, 10, 10)  # TensorRT-LLM's executor setting, as in the bench
    cpu_acc: dict[str, float] = {}  # the executor thread's CPU seconds per callback
    bias = clock_bias()
    timed = ReferenceExecutor._timed

    def timed_with_cpu(self, fn, *args, layer_hook: bool = False):
        """The executor's own timer (wall time per callback in ``callback_times``), with the thread's
        CPU time read around it, outside the span it charges."""
        c0 = time.thread_time()
        try:
            return timed(self, fn, *args, layer_hook=layer_hook)
        finally:
            cpu_acc[fn.__name__] = cpu_acc.get(fn.__name__, 0.0) + time.thread_time() - c0 - bias

    per_iter: list[dict[str, float]] = []
    step = ReferenceExecutor.step

    cpu_iter: list[dict[str, float]] = []

    def timed_step(self):
        acc = self.callback_times
        before = {k: v[1] for k, v in acc.items()}
        cpu_before = dict(cpu_acc)
        step(self)
        per_iter.append({k: v[1] - before.get(k, 0.0) for k, v in acc.items()})
        cpu_iter.append({k: v - cpu_before.get(k, 0.0) for k, v in cpu_acc.items()})

    ReferenceExecutor._timed = timed_with_cpu
    ReferenceExecutor.step = timed_step
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="gdskv-split-", dir=base)
    try:
        out = bench_executor.executor_cost(root, torch.device(args.device), KvikioDefaults(), Tracer(None, False),
                                           requests=args.requests, layers=args.layers, new_tokens=args.new_tokens)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in out["rounds"]:
        print(f"{r['what']}: {r['callback_us_per_iteration']} us/iteration, {r['iteration_us']}")
    n = len(per_iter) // len(out["rounds"])
    for rnd in range(len(out["rounds"])):
        its = per_iter[rnd * n:(rnd + 1) * n]
        first = {k: round(v * 1e6) for k, v in sorted(its[0].items(), key=lambda kv: -kv[1])}
        print(f"round {rnd}: first iteration us {first}")
        cpus = cpu_iter[rnd * n:(rnd + 1) * n]
        for label, pick in (("callbacks", lambda k: k not in _LAYER_HOOKS), ("layer hooks", _LAYER_HOOKS.__contains__)):
            wall = [sum(v for k, v in it.items() if pick(k)) * 1e6 for it in its]
            on_cpu = [sum(v for k, v in it.items() if pick(k)) * 1e6 for it in cpus]
            print(f"round {rnd}: {label}, wall / executor-thread CPU us: first iteration {wall[0]:.0f} / "
                  f"{on_cpu[0]:.0f}, the rest {sum(wall[1:]):.0f} / {sum(on_cpu[1:]):.0f}")
        names = set().union(*its[1:]) if len(its) > 1 else set()
        med = {k: statistics.median([it.get(k, 0.0) for it in its[1:]]) * 1e6 for k in names}
        print(f"round {rnd}: steady median us {({k: round(v, 1) for k, v in sorted(med.items(), key=lambda kv: -kv[1])})}")
        if len(its) > 1:  # the costliest steady iteration: where the requests finish
            worst = max(range(1, len(its)), key=lambda i: sum(its[i].values()))
            top = {k: round(v * 1e6) for k, v in sorted(its[worst].items(), key=lambda kv: -kv[1]) if v * 1e6 >= 1}
            print(f"round {rnd}: costliest steady iteration ({worst} of {len(its)}) us {top}")


if __name__ == "__main__":
    main()
