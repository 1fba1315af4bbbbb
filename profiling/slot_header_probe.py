"""What reading arena slot headers from the CPU costs, and why (run on the GPU host).

    python profiling/slot_header_probe.py [--block 256KiB] [--blocks 4096] [--dir /dev/shm]

Saves ``--blocks`` blocks into a slot arena, then times reading every slot's header fields
(156 bytes) several ways: through the registered slab mapping (twice, then again after the
GPU has DMA'd the payloads once more), with ``pread`` on the slab file, and with one numpy
gather.  A plain tmpfs mapping that is not registered with CUDA and never DMA'd is the
control.  Prints microseconds per slot for each, as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gds_kv_connector.arena import SlotArena  # noqa: E402
from gds_kv_connector.block_io import save_blocks  # noqa: E402
from gds_kv_connector.engines import make_engine  # noqa: E402
from gds_kv_connector.pool import BlockPool  # noqa: E402
from gds_kv_connector.pool_format import HEADER_FIELDS_SIZE, ZERO_KEY  # noqa: E402
from gds_kv_connector.settings import parse_size  # noqa: E402


def per_slot_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return round((time.perf_counter() - t0) / n * 1e6, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", default="256KiB")
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    size, n = parse_size(a.block), a.blocks
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = tempfile.mkdtemp(prefix="gdskv-header-probe-", dir=a.dir)
    out: dict = {"block": size, "blocks": n, "device": str(device)}
    try:
        engine = make_engine("auto", device, 16)
        pool = BlockPool((root,), hashlib.sha256(root.encode()).digest(), size, 32, refs=True, index_ttl_s=600)
        arena = pool.arena = SlotArena(pool, engine, (n + 2) * pool.file_size + (64 << 20), 256 << 20, 5.0)
        arena.start(background=False)
        kv = torch.randint(0, 256, (n, size), dtype=torch.uint8, device=device)
        views = [kv[i] for i in range(n)]
        keys = [hashlib.sha256(b"%d" % i).digest() for i in range(n)]
        for i in range(0, n, 256):
            save_blocks(pool, engine, keys[i:i + 256], [ZERO_KEY] * len(keys[i:i + 256]), views[i:i + 256])
        refs = [arena.cached_ref(k) for k in keys]
        slots = [(arena._slabs[r.slab], r.slot) for r in refs]
        sb = arena.slot_bytes

        def via_map() -> None:
            for slab, slot in slots:
                slab.mm[slot * sb:slot * sb + HEADER_FIELDS_SIZE]

        def via_pread() -> None:
            for slab, slot in slots:
                os.pread(slab.fd, HEADER_FIELDS_SIZE, slot * sb)

        def via_gather() -> None:
            by: dict = {}
            for slab, slot in slots:
                by.setdefault(slab.name, (slab, []))[1].append(slot)
            for slab, idx in by.values():
                slab.array.reshape(slab.nslots, sb)[np.asarray(idx), :HEADER_FIELDS_SIZE].copy()

        out["map_pass1_us"] = per_slot_us(via_map, n)
        out["map_pass2_us"] = per_slot_us(via_map, n)
        out["pread_us"] = per_slot_us(via_pread, n)
        out["gather_us"] = per_slot_us(via_gather, n)
        pairs = [(arena.payload_addr(r.slab, r.slot), views[i]) for i, r in enumerate(refs)]
        t0 = time.perf_counter()
        engine.copy_to_host(pairs, sb)
        out["dma_again_gbps"] = round(n * size / (time.perf_counter() - t0) / 1e9, 2)
        out["map_after_dma_us"] = per_slot_us(via_map, n)
        t0 = time.perf_counter()
        engine.copy_from_host(pairs, sb)
        out["dma_from_host_gbps"] = round(n * size / (time.perf_counter() - t0) / 1e9, 2)
        out["map_after_read_dma_us"] = per_slot_us(via_map, n)
        # control: a tmpfs mapping never registered or DMA'd, headers written by the CPU
        path = os.path.join(root, "control")
        with open(path, "wb") as fh:
            fh.truncate(n * sb)
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, n * sb, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0x8000))
        for i in range(n):
            mm[i * sb:i * sb + 8] = b"\1" * 8

        def control() -> None:
            for i in range(n):
                mm[i * sb:i * sb + HEADER_FIELDS_SIZE]

        out["control_map_us"] = per_slot_us(control, n)
        arena.drop_caches()
        # the load path's batch check (one call per batch of slots, as block_io makes it)
        out["check_records_cold_us"] = per_slot_us(lambda: arena.check_records(refs), n)
        out["check_records_warm_us"] = per_slot_us(lambda: arena.check_records(refs), n)
        mm.close()
        os.close(fd)
        arena.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
