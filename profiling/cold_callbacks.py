"""What a connector callback with nothing to do costs when the caches are cold, as they are after a
forward pass: the floor under every iteration's callbacks.

    python profiling/cold_callbacks.py [--tree DIR] [--calls 200] [--mib 0,32]

For each size in ``--mib``, writes that many MiB of other memory before each call, then times one
call of each per-iteration callback with nothing to do (no saves, loads or reports: a decode step of
a request whose blocks are all saved), and prints the median.  CPU KV cache, host-memory pool under
/dev/shm (``bench_executor.cpu_connector``); imports the package from ``--tree`` (default: this
checkout).
"""

from __future__ import annotations

import argparse
import statistics
import time

from tree_checkout import add_tree_argument, use_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tree_argument(ap)
    ap.add_argument("--calls", type=int, default=200, help="calls timed per callback and size")
    ap.add_argument("--mib", default="0,32", help="MiB written before each call, comma-separated")
    a = ap.parse_args()
    sizes = [int(x) for x in a.mib.split(",") if x.strip()]
    if a.calls < 1 or not sizes or min(sizes) < 0:
        raise SystemExit("cold_callbacks.py: --calls must be 1 or more and --mib sizes 0 or more")
    tree = use_tree(a.tree, "cold_callbacks.py")
    from bench_executor import cpu_connector
    from gds_kv_connector.trtllm_api import SchedulerOutput

    junk = bytearray(max(sizes) << 20)
    fill = {mib: b"\x01" * (mib << 20) for mib in sizes}
    with cpu_connector("cold-callbacks", 32, 64) as (sched, worker):
        empty = SchedulerOutput()
        calls = {"(an empty Python call)": lambda: None,  # the timing's own floor
                 "build_connector_meta": lambda: sched.build_connector_meta(empty),
                 "bind_connector_meta": lambda: worker.bind_connector_meta(None),
                 "start_load_kv": lambda: worker.start_load_kv(None),
                 "wait_for_save": lambda: worker.wait_for_save(None),
                 "get_finished": lambda: worker.get_finished([], [])}
        print(f"{tree}: median us per call of {a.calls}")
        for mib in sizes:
            for name, fn in calls.items():
                ts = []
                for _ in range(a.calls):
                    if mib:
                        junk[:mib << 20] = fill[mib]
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                print(f"  {mib:4d} MiB written before each  {name:24s} {1e6 * statistics.median(ts):7.2f}")


if __name__ == "__main__":
    main()
