"""Each connector callback's total time per round of the bench's executor phase, over several runs, for
one checkout: the figures to alternate between two trees when a change moves one callback by less than
the whole figure's run-to-run spread.

    python profiling/callback_totals.py [--tree DIR] [--runs 5] [--device cuda] [--new-tokens 16]

Imports the package and the bench from ``--tree`` (default: this checkout), runs
``bench_executor.executor_cost`` ``--runs`` times (a cold round that saves, a warm round that loads the
same prompts; a host-memory pool under /dev/shm with a 512 MiB arena), and prints the median of the
runs' microseconds per iteration with every run's figure, then each callback's median total per round
(``cold:`` / ``warm:``), layer hooks left out.  One process per tree; alternate trees in the shell:

    for t in ../base . ../base .; do python profiling/callback_totals.py --tree $t --runs 5; done
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import shutil
import statistics
import tempfile

from tree_checkout import add_tree_argument, use_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_tree_argument(ap, "package and profiling/")
    ap.add_argument("--runs", type=int, default=5, help="executor phases run (each a cold and a warm round)")
    ap.add_argument("--device", default="cpu", help="where the KV pool lives: cpu or cuda")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens each request generates (the bench's 16)")
    a = ap.parse_args()
    if a.runs < 1 or a.new_tokens < 1:
        raise SystemExit("callback_totals.py: --runs and --new-tokens must be 1 or more")
    tree = use_tree(a.tree, "callback_totals.py", its_profiling=True)
    import torch
    import bench_executor
    from bench_common import KvikioDefaults, Tracer
    gc.set_threshold(20000, 10, 10)  # TensorRT-LLM's executor runs with 20000, as the bench does
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    totals: dict[str, list[float]] = collections.defaultdict(list)
    per_iter = []
    for _ in range(a.runs):
        root = tempfile.mkdtemp(dir=base)
        try:
            r = bench_executor.executor_cost(root, torch.device(a.device), KvikioDefaults(), Tracer(None, False),
                                             arena_bytes=512 << 20, new_tokens=a.new_tokens)
        finally:
            shutil.rmtree(root)
        per_iter.append(r["callback_us_per_iteration"])
        for rnd in r["rounds"]:
            for name, v in rnd["by_callback"].items():
                if name not in ("wait_for_layer_load", "save_kv_layer"):
                    totals[f"{rnd['what'][:4]}:{name}"].append(v["total_us"])
    print(f"{tree}: us/iteration median {statistics.median(per_iter):.1f}, runs "
          f"{', '.join(f'{x:.1f}' for x in per_iter)}")
    for key in sorted(totals):
        print(f"  {key:36s} {statistics.median(totals[key]):8.0f} us per round")


if __name__ == "__main__":
    main()
