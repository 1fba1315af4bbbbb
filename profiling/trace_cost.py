"""What ``TLLM_GDS_KV_TRACE=torch`` costs a connector callback: a no-op decorated with ``traced``,
timed without a profiler and while torch.profiler records, against the same no-op undecorated.

    python profiling/trace_cost.py [--calls 200000]

Starts itself with ``TLLM_GDS_KV_TRACE=torch`` when not already (the mode is read at import) and
prints microseconds per call, the minimum of five repeats, with the ratio to the bare call.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000, help="calls per repeat (a tenth while recording)")
    a = ap.parse_args()
    if a.calls < 10:
        raise SystemExit("trace_cost.py: --calls must be 10 or more")
    if os.environ.get("TLLM_GDS_KV_TRACE") != "torch":
        os.environ["TLLM_GDS_KV_TRACE"] = "torch"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    from gds_kv_connector import trace_ranges

    if trace_ranges.MODE != "torch":
        raise SystemExit(f"trace_cost.py: the package imported under {trace_ranges.MODE}, not torch")

    def bare() -> int:
        return 1

    traced = trace_ranges.traced("sched/match")(bare)

    def per_call_us(fn, n: int) -> float:
        return 1e6 * min(timeit.repeat(fn, number=n, repeat=5)) / n

    base = per_call_us(bare, a.calls)
    idle = per_call_us(traced, a.calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        recording = per_call_us(traced, a.calls // 10)
    print(f"bare call                   {base:7.3f} us")
    print(f"traced, no profiler         {idle:7.3f} us  (x{idle / base:.1f} the bare call, +{idle - base:.3f} us)")
    print(f"traced, profiler recording  {recording:7.3f} us  (x{recording / idle:.1f} the unrecorded traced call)")


if __name__ == "__main__":
    main()
