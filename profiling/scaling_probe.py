"""Do link(2) on tmpfs and the arena's DMA scale with threads on their own, without block_io?

    python profiling/scaling_probe.py [--dir /dev/shm] [--threads 1,2,4,8] [--block 256KiB]

Two of the steps an arena save makes per batch, each run alone from T Python threads:
``links``: each thread links one file under 4096 names spread over 256 directories, 256 names per
``native.link_keys`` call (the GIL released for the call), as ``pool.publish_refs`` does;
``dma``: each thread copies batches of 256 blocks from a CUDA tensor into consecutive slots of a
pinned host buffer through ``CudaHostDma.copy`` (2D copies split over its streams), as
``engine.copy_to_host`` does.  If either stops scaling by itself, arena_scaling.py's per-step growth
is that step's own contention, not the GIL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gds_kv_connector import native  # noqa: E402
from gds_kv_connector.settings import parse_size  # noqa: E402

_NAMES = 4096
_BATCH = 256


def _run(threads: int, work) -> float:
    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def links(root: str, threads: int) -> None:
    dirs = [os.path.join(root, f"{b:02x}") for b in range(256)]
    for d in dirs:
        os.makedirs(d, exist_ok=True)

    def work(t: int) -> None:
        src = os.path.join(root, f"src{t}")
        open(src, "wb").close()
        keys = [bytes([i % 256, t]) + i.to_bytes(30, "little") for i in range(_NAMES)]
        for lo in range(0, _NAMES, _BATCH):
            errs = native.link_keys(src, tuple(dirs), keys[lo:lo + _BATCH], ".blk")
            assert errs is not None and not any(errs), errs
    wall = _run(threads, work)
    n = threads * _NAMES
    print(f"links {threads:2d} thread(s): {n / wall / 1e6:.3f} M links/s, {wall / n * 1e6:.2f} us/link overall")
    for d in dirs:
        shutil.rmtree(d)


def dma(threads: int, size: int, rounds: int) -> None:
    from gds_kv_connector.engines.host_dma import CudaHostDma

    pitch = size + 4096
    dev = torch.device("cuda")
    hd = CudaHostDma(dev)
    kv = torch.randint(0, 256, (threads * _BATCH, size), dtype=torch.uint8, device=dev)
    host = torch.empty(threads * _BATCH * pitch, dtype=torch.uint8, pin_memory=True)
    base = host.data_ptr()
    views = [kv[i] for i in range(threads * _BATCH)]

    def work(t: int) -> None:
        pairs = [(base + i * pitch, views[i]) for i in range(t * _BATCH, (t + 1) * _BATCH)]
        for _ in range(rounds):
            hd.copy(pairs, pitch, to_host=True)
    _run(threads, work)  # warm-up: streams, first touches
    wall = _run(threads, work)
    nbytes = threads * _BATCH * size * rounds
    print(f"dma   {threads:2d} thread(s): {nbytes / wall / 1e9:.2f} GB/s D2H, "
          f"{wall / (threads * _BATCH * rounds) * 1e6:.2f} us/block overall")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--block", default="256KiB")
    ap.add_argument("--rounds", type=int, default=16)
    a = ap.parse_args()
    counts = [int(t) for t in a.threads.split(",")]
    root = tempfile.mkdtemp(prefix="gdskv-scaling-probe-", dir=a.dir)
    try:
        for t in counts:
            links(root, t)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if torch.cuda.is_available():
        for t in counts:
            dma(t, parse_size(a.block), a.rounds)
    else:
        print("dma: no CUDA device, skipped")


if __name__ == "__main__":
    main()
