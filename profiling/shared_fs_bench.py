"""Save and load bandwidth through a GlusterFS FUSE mount against the same local disk, in one run (issue 43).

Starts the shared-filesystem rig of the tests (``tests/shared_fs_rig.py``: glusterd, a one-brick volume on a
local directory, two FUSE mounts ``a`` and ``b``), then, in rotating order, for each block size:

* ``local``: blocks saved to and loaded from a directory on the brick's own disk;
* ``gluster``: saved through mount ``a`` and loaded through mount ``b`` (another client: a second node's view).

Blocks move with the package's POSIX engine (the pool and engine a connector's worker makes from the settings,
``TLLM_GDS_KV_IO_THREADS`` etc. as set in the environment) through the pool's store
(``gds_kv_connector.store.base.open_store``: ``save`` / ``pin`` / ``load``); page caches are dropped before each load (root), so loads
are cold on both.  Prints GB/s per leg, the medians and the ratio gluster / local.

``--strace`` also counts the system calls of one save of N blocks and one load of N blocks on each target
(``strace -f -c -e trace=file,desc``), per block: each metadata call is a round trip to the server on a network
filesystem, which is what such a filesystem multiplies.

    python profiling/shared_fs_bench.py [--sizes 256KiB,2MiB] [--mib 256] [--rounds 3] [--strace] [--base DIR]

Needs root, /dev/fuse and the glusterfs packages (the line printed when they are missing says which).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's root: the rig is tests/support/shared_fs_rig.py

from tests.support import shared_fs_rig as rig  # noqa: E402

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)(KiB|MiB|GiB)?", text.strip())
    if not m:
        raise SystemExit(f"bad size {text!r}")
    return int(m.group(1)) * UNITS.get(m.group(2) or "", 1)


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError:
        pass


def _worker(root: str, block_bytes: int):
    """A connector worker over ``root`` whose pool holds blocks of ``block_bytes`` (its pool and engine are used)."""
    import torch
    from gds_kv_connector.simulator import fake_llm_args

    from gds_kv_connector import GdsKvConnectorWorker

    os.environ["TLLM_GDS_KV_ROOT"] = root
    worker = GdsKvConnectorWorker(fake_llm_args(16, model=f"shared-fs-bench-{block_bytes}"))
    worker.register_kv_caches(torch.zeros((2, 1, 2, block_bytes // 4), dtype=torch.bfloat16))
    return worker


def _blocks(n: int, block_bytes: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    keys = [bytes(torch.randint(0, 256, (32,), dtype=torch.uint8, generator=g).tolist()) for _ in range(n)]
    views = [torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=g) for _ in range(n)]
    return keys, views


def save(worker, keys, views) -> float:
    from gds_kv_connector.store.base import open_store
    parents = [b"\0" * 32] + keys[:-1]
    t0 = time.perf_counter()
    out = open_store(worker.pool, worker.transfers.engine).save(keys, parents, views)
    dt = time.perf_counter() - t0
    if out.failed or out.published != len(keys):
        raise RuntimeError(f"save: {out.published} of {len(keys)} published, failed {out.failed[:2]}")
    return dt


def load(worker, keys, block_bytes: int, expect=None) -> float:
    import torch
    from gds_kv_connector.store.base import open_store
    out = [torch.empty(block_bytes, dtype=torch.uint8) for _ in keys]
    t0 = time.perf_counter()
    pins = open_store(worker.pool).pin(keys)
    try:
        open_store(worker.pool, worker.transfers.engine).load(pins, out, verify=True, retries=0,
                                                              deadline=time.monotonic() + 300)
    finally:
        worker.pool.unpin_all(pins)
    dt = time.perf_counter() - t0
    if expect is not None and not all(torch.equal(a, b) for a, b in zip(out, expect)):
        raise RuntimeError("a loaded block differs from what was saved")
    return dt


def leg(save_root: str, load_root: str, block_bytes: int, n: int, seed: int) -> dict[str, float]:
    keys, views = _blocks(n, block_bytes, seed)
    w_save = _worker(save_root, block_bytes)
    try:
        t_save = save(w_save, keys, views)
    finally:
        w_save.shutdown()
    drop_caches()
    w_load = _worker(load_root, block_bytes)  # a fresh worker (no index), on the other mount for gluster
    try:
        t_load = load(w_load, keys, block_bytes, expect=views)
    finally:
        w_load.shutdown()
    gb = n * block_bytes / 1e9
    return {"save_gbps": gb / t_save, "load_gbps": gb / t_load, "save_s": t_save, "load_s": t_load}


# -- system calls per block -----------------------------------------------------------------------------
def strace_child(args) -> int:
    """One save (or load) of ``--n`` blocks, run under strace by the parent."""
    block_bytes = args.block
    keys, views = _blocks(args.n, block_bytes, args.seed)
    worker = _worker(args.root, block_bytes)
    try:
        if args.child == "save":
            save(worker, keys, views)
        else:
            load(worker, keys, block_bytes)
    finally:
        worker.shutdown()
    return 0


def count_syscalls(root: str, what: str, n: int, block_bytes: int, seed: int, baseline: dict | None = None) -> dict:
    """strace -c of a child doing ``what`` (save/load) of n blocks; the counts of a child doing it for 0 blocks are
    subtracted (``baseline``), so what is left is per the n blocks."""
    out = tempfile.mktemp(prefix="gdskv-strace-")
    cmd = ["strace", "-f", "-c", "-U", "calls,errors,name", "-e", "trace=file,desc", "-o", out,
           sys.executable, os.path.abspath(__file__), "--child", what, "--root", root, "--n", str(n),
           "--block", str(block_bytes), "--seed", str(seed)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    counts = {}
    with open(out) as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 2 and parts[0].isdigit() and parts[-1].isidentifier() and parts[-1] != "total":
                counts[parts[-1]] = int(parts[0])
    os.unlink(out)
    if baseline is not None:
        counts = {k: v - baseline.get(k, 0) for k, v in counts.items() if v - baseline.get(k, 0) > 0}
    return counts


FILE_CALLS = ("openat", "open", "close", "newfstatat", "fstat", "statx", "lstat", "stat", "linkat", "link", "rename",
              "renameat", "renameat2", "unlink", "unlinkat", "fsync", "fdatasync", "pwrite64", "pwritev", "pwritev2",
              "pread64", "preadv", "preadv2", "write", "read", "mkdir", "mkdirat", "chmod", "fchmod", "flock", "fcntl",
              "getdents64", "fallocate", "ftruncate")


def per_block(counts: dict, n: int) -> dict:
    """Calls per block of the file and descriptor calls that reach the filesystem (mmap and the like left out)."""
    return {k: round(v / n, 2) for k, v in sorted(counts.items(), key=lambda kv: -kv[1]) if k in FILE_CALLS}


def metadata_latency(root: str, n: int = 200) -> dict[str, float]:
    """Microseconds per call of the metadata operations a block costs (its publication: create O_EXCL, close,
    link, unlink; a lookup: stat; a pin: open and close), each timed alone over ``n`` files; the second node's
    stat (``stat_other``) goes through ``other`` when given."""
    os.makedirs(root, exist_ok=True)
    names = ("create", "close", "link", "unlink", "stat", "open_ro", "close_ro")
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(n):
        tmp, final = os.path.join(root, f".tmp-{i}"), os.path.join(root, f"{i}.blk")
        t0 = time.perf_counter()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        t1 = time.perf_counter()
        os.close(fd)
        t2 = time.perf_counter()
        os.link(tmp, final)
        t3 = time.perf_counter()
        os.unlink(tmp)
        t4 = time.perf_counter()
        times["create"].append(t1 - t0)
        times["close"].append(t2 - t1)
        times["link"].append(t3 - t2)
        times["unlink"].append(t4 - t3)
    for i in range(n):
        final = os.path.join(root, f"{i}.blk")
        t0 = time.perf_counter()
        os.stat(final)
        t1 = time.perf_counter()
        fd = os.open(final, os.O_RDONLY)
        t2 = time.perf_counter()
        os.close(fd)
        t3 = time.perf_counter()
        times["stat"].append(t1 - t0)
        times["open_ro"].append(t2 - t1)
        times["close_ro"].append(t3 - t2)
    shutil.rmtree(root, ignore_errors=True)
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256KiB,2MiB")
    ap.add_argument("--mib", type=int, default=256, help="MiB saved and loaded per leg")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strace", action="store_true")
    ap.add_argument("--strace-blocks", type=int, default=64)
    ap.add_argument("--base", default="", help="directory for the brick, mounts and the local pool (default: a new "
                                               "one under /var/tmp, on the disk)")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", choices=("save", "load"), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--block", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return strace_child(args)
    why = rig.unavailable()
    if why:
        print(why)
        return 2
    base = args.base or tempfile.mkdtemp(prefix="gdskv-sharedfs-bench-", dir="/var/tmp")
    cluster = rig.GlusterRig(base)
    results: dict = {"legs": [], "strace": {}}
    try:
        cluster.start()
        local = os.path.join(base, "local")
        version = subprocess.run(["glusterfs", "--version"], capture_output=True, text=True, check=False).stdout
        print(f"GlusterFS {version.split()[1]}"
              f" one brick at {cluster.brick}, mounts {cluster.mount_a} (save) and {cluster.mount_b} (load); "
              f"local pool {local} on the same disk; {os.cpu_count()} CPUs")
        for size_text in args.sizes.split(","):
            bb = parse_size(size_text)
            n = max(1, args.mib * (1 << 20) // bb)
            rows = {"local": [], "gluster": []}
            for r in range(args.rounds):
                order = ("local", "gluster") if r % 2 == 0 else ("gluster", "local")
                for target in order:
                    sub = f"r{r}-{bb}"
                    if target == "local":
                        res = leg(os.path.join(local, sub), os.path.join(local, sub), bb, n, seed=r)
                    else:
                        res = leg(os.path.join(cluster.mount_a, sub), os.path.join(cluster.mount_b, sub), bb, n, seed=r)
                    rows[target].append(res)
                    results["legs"].append(dict(res, target=target, block_bytes=bb, blocks=n, round=r))
                    print(f"  {size_text:>7} {target:<8} round {r}: save {res['save_gbps']:.3f} GB/s, "
                          f"load {res['load_gbps']:.3f} GB/s ({n} blocks)", flush=True)
                shutil.rmtree(os.path.join(local, f"r{r}-{bb}"), ignore_errors=True)
                shutil.rmtree(os.path.join(cluster.mount_a, f"r{r}-{bb}"), ignore_errors=True)
            med = {t: {k: statistics.median(x[k] for x in rows[t]) for k in ("save_gbps", "load_gbps")} for t in rows}
            loc, glu = med["local"], med["gluster"]
            print(f"{size_text:>7}: save local {loc['save_gbps']:.3f}, gluster {glu['save_gbps']:.3f}"
                  f" GB/s (x{med['gluster']['save_gbps'] / med['local']['save_gbps']:.2f}); load local "
                  f"{med['local']['load_gbps']:.3f}, gluster {med['gluster']['load_gbps']:.3f} GB/s "
                  f"(x{med['gluster']['load_gbps'] / med['local']['load_gbps']:.2f}); medians of {args.rounds}")
        results["metadata_us"] = {}
        for target, where in (("local", os.path.join(local, "meta")),
                              ("gluster", os.path.join(cluster.mount_a, "meta"))):
            results["metadata_us"][target] = metadata_latency(where)
            print(f"metadata call, median us, {target}: {results['metadata_us'][target]}")
        if args.strace:
            if shutil.which("strace") is None:
                print("strace not installed: no system-call counts")
            else:
                bb, n = 256 << 10, args.strace_blocks
                for target, sroot, lroot in (("local", os.path.join(local, "st"), os.path.join(local, "st")),
                                             ("gluster", os.path.join(cluster.mount_a, "st"),
                                              os.path.join(cluster.mount_b, "st"))):
                    base_save = count_syscalls(sroot + "-0", "save", 1, bb, 99)
                    saves = count_syscalls(sroot, "save", n + 1, bb, 11, base_save)
                    base_load = count_syscalls(lroot, "load", 1, bb, 11)
                    loads = count_syscalls(lroot, "load", n + 1, bb, 11, base_load)
                    results["strace"][target] = {"save": per_block(saves, n), "load": per_block(loads, n)}
                    print(f"system calls per block, {target} ({n} blocks of 256 KiB, strace -f -c -e trace=file,desc):")
                    print(f"  save: {per_block(saves, n)}")
                    print(f"  load: {per_block(loads, n)}")
    finally:
        problems = cluster.stop()
        if problems:
            print("rig stop:", "; ".join(problems))
        if not args.base:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
