"""The unindexed match's two C calls, one after the other, against ``native.chain_present``, which
stats the files while the chain is hashed.

    python profiling/chain_present_probe.py [--calls 15] [--dir /dev/shm]

Keys a 128k-token prompt (4096 blocks of 32 tokens), publishes an empty file under every key in a
temporary directory laid out as a pool's 256 key directories, and alternates
``chain_keys`` + ``present_run`` (what the scheduler runs now) with ``chain_present`` over the same
tokens, for a prompt whose every block is present and one whose first block is missing; prints
each one's median and minimum in ms and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gds_kv_connector import _native as lib  # noqa: E402

BLOCKS, TPB, SUFFIX = 4096, 32, ".blk"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="gdskv-chain-present-", dir=args.dir)
    try:
        dirs = tuple(os.path.join(root, "a", "b", f"{b:02x}") for b in range(256))  # as deep as a pool's
        for d in dirs:
            os.makedirs(d)
        rng = random.Random(7)
        tokens = [rng.randrange(32000) for _ in range(BLOCKS * TPB + 1)]
        seed = bytes(range(32))
        keys = lib.chain_keys(seed, tokens, 0, TPB, BLOCKS)
        for k in keys:
            open(f"{dirs[k[0]]}/{k.hex()}{SUFFIX}", "wb").close()
        for label, prev in (("all present", seed), ("first missing", bytes(32))):
            seq: list[float] = []
            fused: list[float] = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                k1 = lib.chain_keys(prev, tokens, 0, TPB, BLOCKS)
                s1 = lib.present_run(dirs, k1, 0, SUFFIX)
                t1 = time.perf_counter()
                k2, s2 = lib.chain_present(prev, tokens, 0, TPB, BLOCKS, dirs, SUFFIX)
                t2 = time.perf_counter()
                if (k1, s1) != (k2, s2):
                    raise SystemExit("chain_present disagrees with chain_keys + present_run")
                seq.append(t1 - t0)
                fused.append(t2 - t1)
            ms = statistics.median(seq) * 1e3, statistics.median(fused) * 1e3
            print(f"{label} ({len(s1)} present): chain_keys+present_run median {ms[0]:.3f} min {min(seq) * 1e3:.3f} ms"
                  f"  chain_present median {ms[1]:.3f} min {min(fused) * 1e3:.3f} ms  x{ms[1] / ms[0]:.2f}",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
