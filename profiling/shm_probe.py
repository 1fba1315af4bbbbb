"""What does a host-memory (/dev/shm) pool cost on this machine, path by path?

Measures, with CuPy on the current GPU: cudaHostRegister/Unregister time of mmapped tmpfs files
by size (fresh and populated), DMA bandwidth into such a registered mapping (large copies on
several streams, 256 KiB copies one call each, and 2D copies that coalesce consecutive blocks
around 4 KiB headers), and the per-file cost of mmap+register+DMA+unregister for one file per
block.  Writes JSON to argv[1].  It decides how the connector's arena is built (docs/format.md).
"""
import json
import mmap
import os
import sys
import time

import cupy as cp
import numpy as np

MiB = 1 << 20
rt = cp.cuda.runtime
D = os.environ.get("PROBE_DIR", "/dev/shm")
res: dict = {}


def reg(ptr, n, flags=0):
    t = time.perf_counter(); rt.hostRegister(ptr, n, flags); return time.perf_counter() - t


def unreg(ptr):
    t = time.perf_counter(); rt.hostUnregister(ptr); return time.perf_counter() - t


def mapfile(path, n, populate=False):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, n)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0x8000) if populate else 0)
    m = mmap.mmap(fd, n, flags=flags)
    a = np.frombuffer(m, dtype=np.uint8)
    return fd, m, a


def ptr_of(a):
    return a.__array_interface__["data"][0]


gpu = cp.empty(1 << 30, dtype=cp.uint8)
gpu[:] = 7
streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]

# 1. registration cost by size
rows = []
for size in (4 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB):
    for populate in (False, True):
        p = f"{D}/probe-{size}-{populate}"
        t0 = time.perf_counter()
        fd, m, a = mapfile(p, size, populate)
        t_map = time.perf_counter() - t0
        t_reg = reg(ptr_of(a), size)
        # DMA D2H then H2D, 4 MiB pieces on 4 streams
        n = size // (4 * MiB)
        cp.cuda.Device().synchronize()
        out = {}
        for d in ("d2h", "h2d"):
            t = time.perf_counter()
            for rep in range(2 if size < 1024 * MiB else 1):
                for i in range(n):
                    s = streams[i % 4]
                    off = i * 4 * MiB
                    if d == "d2h":
                        rt.memcpyAsync(ptr_of(a) + off, gpu.data.ptr + off, 4 * MiB, rt.memcpyDeviceToHost, s.ptr)
                    else:
                        rt.memcpyAsync(gpu.data.ptr + off, ptr_of(a) + off, 4 * MiB, rt.memcpyHostToDevice, s.ptr)
            for s in streams:
                s.synchronize()
            dt = time.perf_counter() - t
            out[d] = round(size * (2 if size < 1024 * MiB else 1) / dt / 1e9, 2)
        t_un = unreg(ptr_of(a))
        t_rereg = reg(ptr_of(a), size)
        unreg(ptr_of(a))
        del a
        m.close(); os.close(fd); os.unlink(p)
        rows.append({"MiB": size // MiB, "populate": populate, "map_ms": round(t_map * 1e3, 3),
                     "register_ms": round(t_reg * 1e3, 3), "register_GBps": round(size / t_reg / 1e9, 2),
                     "reregister_ms": round(t_rereg * 1e3, 3),
                     "unregister_ms": round(t_un * 1e3, 3), "dma_GBps": out})
        print(rows[-1], flush=True)
res["register"] = rows

# 2. small copies into one registered 1 GiB mapping, slots = 4 KiB header + payload
size = 1024 * MiB
fd, m, a = mapfile(f"{D}/probe-slab", size, True)
base = ptr_of(a)
reg(base, size)
small = []
for payload in (256 << 10, 1 * MiB, 2304 << 10, 4 * MiB, 10 * MiB):
    slot = 4096 + payload
    n = min(size // slot, 1024)
    for mode in ("per-block", "2d"):
        for d in ("d2h", "h2d"):
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            reps = 3
            for _ in range(reps):
                if mode == "per-block":
                    for i in range(n):
                        s = streams[i % 4]
                        h, g = base + i * slot + 4096, gpu.data.ptr + i * payload
                        if d == "d2h":
                            rt.memcpyAsync(h, g, payload, rt.memcpyDeviceToHost, s.ptr)
                        else:
                            rt.memcpyAsync(g, h, payload, rt.memcpyHostToDevice, s.ptr)
                else:
                    per = (n + 3) // 4
                    for k in range(4):
                        lo, hi = k * per, min(n, (k + 1) * per)
                        if lo >= hi:
                            continue
                        h, g = base + lo * slot + 4096, gpu.data.ptr + lo * payload
                        if d == "d2h":
                            rt.memcpy2DAsync(h, slot, g, payload, payload, hi - lo, rt.memcpyDeviceToHost, streams[k].ptr)
                        else:
                            rt.memcpy2DAsync(g, payload, h, slot, payload, hi - lo, rt.memcpyHostToDevice, streams[k].ptr)
            for s in streams:
                s.synchronize()
            dt = time.perf_counter() - t
            small.append({"payload_KiB": payload >> 10, "mode": mode, "dir": d, "blocks": n,
                          "GBps": round(reps * n * payload / dt / 1e9, 2)})
            print(small[-1], flush=True)
res["slab_copies"] = small
unreg(base)
del a
m.close(); os.close(fd); os.unlink(f"{D}/probe-slab")

# 3. one file per block: create, mmap, register, DMA, unregister, unmap, close
per_file = []
for payload in (256 << 10, 4 * MiB):
    n = 64
    t = time.perf_counter()
    for i in range(n):
        p = f"{D}/probe-f{i}"
        fd, m, a = mapfile(p, 4096 + payload, False)
        pa = ptr_of(a)
        rt.hostRegister(pa, 4096 + payload, 0)
        rt.memcpyAsync(pa + 4096, gpu.data.ptr + i * payload, payload, rt.memcpyDeviceToHost, streams[0].ptr)
        streams[0].synchronize()
        rt.hostUnregister(pa)
        del a
        m.close(); os.close(fd)
    dt = time.perf_counter() - t
    for i in range(n):
        os.unlink(f"{D}/probe-f{i}")
    per_file.append({"payload_KiB": payload >> 10, "files": n, "us_per_file": round(dt / n * 1e6, 1),
                     "GBps": round(n * payload / dt / 1e9, 2)})
    print(per_file[-1], flush=True)
res["per_file"] = per_file

# 4. pageable-free reference: pinned cudaHostAlloc ceiling
pin = cp.cuda.alloc_pinned_memory(256 * MiB)
pp = pin.ptr
for d in ("d2h", "h2d"):
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for rep in range(4):
        for i in range(64):
            s = streams[i % 4]
            if d == "d2h":
                rt.memcpyAsync(pp + i * 4 * MiB, gpu.data.ptr + i * 4 * MiB, 4 * MiB, rt.memcpyDeviceToHost, s.ptr)
            else:
                rt.memcpyAsync(gpu.data.ptr + i * 4 * MiB, pp + i * 4 * MiB, 4 * MiB, rt.memcpyHostToDevice, s.ptr)
    for s in streams:
        s.synchronize()
    res[f"pinned_{d}_GBps"] = round(4 * 256 * MiB / (time.perf_counter() - t) / 1e9, 2)
print(res["pinned_d2h_GBps"], res["pinned_h2d_GBps"])
json.dump(res, open(sys.argv[1], "w"), indent=1)
