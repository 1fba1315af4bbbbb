"""KvikioEngine on a CUDA device: round trips, the cuFile probe and its fallback, corruption and
truncation as the load path sees them."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gds_kv_connector.format.checksum import checksum_bytes
from gds_kv_connector.engines.base import TransferItem
from gds_kv_connector.format.records import align_up

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("kvikio") is None
                       or importlib.util.find_spec("cupy") is None,
                       reason="needs a CUDA device, KvikIO and CuPy"),
]

REPO = Path(__file__).resolve().parents[2]  # tests/gpu/ is two below the root
HEADER = 4096
DATA_PATHS = ("gds", "cufile-compat", "kvikio-posix", "staged-direct")


@pytest.fixture(scope="module", params=["staged", "kvikio"])
def engine(tmp_path_factory, request):
    """Both ways of moving files without GDS (TLLM_GDS_KV_COMPAT_IO); GDS itself where present."""
    from gds_kv_connector.engines.kvikio_engine import KvikioEngine

    eng = KvikioEngine(io_threads=8, device=torch.device("cuda", 0),
                       probe_dir=str(tmp_path_factory.mktemp("probe")), compat_io=request.param)
    print(f"\nKvikioEngine data path: {eng.data_path()}")
    yield eng
    eng.close()


@pytest.fixture(params=["tmp", "shm"])
def pool_dir(request, tmp_path):
    if request.param == "tmp":
        yield str(tmp_path)
        return
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(prefix="gdskv-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _save(engine, directory: str, views: list[torch.Tensor]) -> tuple[list[str], list[BaseException | None]]:
    """Create block files the way the pool does (O_WRONLY, header first), then write payloads."""
    paths, fds = [], []
    for i in range(len(views)):
        path = os.path.join(directory, f"block{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.pwrite(fd, bytes([i % 256]) * HEADER, 0)
        os.ftruncate(fd, HEADER + align_up(views[i].numel() * views[i].element_size(), 4096))
        paths.append(path)
        fds.append(fd)
    try:
        errors = engine.write([TransferItem(fd, HEADER, v) for fd, v in zip(fds, views)])
    finally:
        for fd in fds:
            os.close(fd)
    return paths, errors


def _load(engine, paths: list[str], views: list[torch.Tensor]) -> list[BaseException | None]:
    fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]
    try:
        return engine.read([TransferItem(fd, HEADER, v) for fd, v in zip(fds, views)])
    finally:
        for fd in fds:
            os.close(fd)


def _blank_files(directory: str, name: str, views: list[torch.Tensor]) -> tuple[list[str], list[int]]:
    """A zeroed file open for writing per view, sized for its header and payload: (paths, fds)."""
    paths, fds = [], []
    for i, view in enumerate(views):
        path = os.path.join(directory, f"{name}{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(fd, HEADER + view.numel())
        paths.append(path)
        fds.append(fd)
    return paths, fds


def _payload(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(HEADER)
        return f.read()


def _pool(kind: str, num_blocks: int, num_layers: int, block_elems: int) -> torch.Tensor:
    shape = (num_blocks, num_layers, 2, block_elems)
    if kind == "bf16":
        return torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")  # FP8 payload bytes


def _block_bytes(pool: torch.Tensor, b: int) -> torch.Tensor:
    return pool[b].reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("kind,block_elems", [("bf16", 8192), ("uint8", 16384), ("uint8", 3000)])
def test_round_trip(engine, pool_dir, kind, block_elems):
    pool = _pool(kind, 6, 4, block_elems)
    views = [_block_bytes(pool, b) for b in range(pool.shape[0])]
    torch.cuda.synchronize()
    paths, errors = _save(engine, pool_dir, views)
    assert errors == [None] * len(views)
    for i, (path, view) in enumerate(zip(paths, views)):
        assert os.path.getsize(path) == HEADER + align_up(view.numel(), 4096)
        with open(path, "rb") as f:
            assert f.read(HEADER) == bytes([i % 256]) * HEADER, "the payload write must keep the header"
        assert _payload(path) == bytes(view.cpu().numpy()) + bytes(align_up(view.numel(), 4096) - view.numel())
    back = torch.zeros_like(pool)
    back_views = [_block_bytes(back, b) for b in range(back.shape[0])]
    assert _load(engine, paths, back_views) == [None] * len(views)
    assert torch.equal(back.view(-1).view(torch.uint8), pool.view(-1).view(torch.uint8))
    assert engine.checksums(back_views) == [checksum_bytes(_payload(p)[:v.numel()]) for p, v in zip(paths, views)]


def test_probe_with_compat_mode_off_succeeds_or_falls_back(tmp_path):
    script = (
        "import os, torch\n"
        "from gds_kv_connector.engines.base import TransferItem\n"
        "from gds_kv_connector.engines.kvikio_engine import KvikioEngine\n"
        f"d = {str(tmp_path)!r}\n"
        "e = KvikioEngine(io_threads=4, device=torch.device('cuda', 0), probe_dir=d)\n"
        "print('DATA_PATH=' + e.data_path(), flush=True)\n"
        "src = torch.randint(0, 256, (256 << 10,), dtype=torch.uint8, device='cuda')\n"
        "dst = torch.zeros_like(src)\n"
        "torch.cuda.synchronize()\n"
        "p = os.path.join(d, 'blk')\n"
        "fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600); os.pwrite(fd, b'h' * 4096, 0)\n"
        "assert e.write([TransferItem(fd, 4096, src)]) == [None]; os.close(fd)\n"
        "fd = os.open(p, os.O_RDONLY)\n"
        "assert e.read([TransferItem(fd, 4096, dst)]) == [None]; os.close(fd)\n"
        "print('ROUND_TRIP=' + str(bool(torch.equal(src, dst))), flush=True)\n"
    )
    env = {**os.environ, "KVIKIO_COMPAT_MODE": "OFF",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    (data_path,) = re.findall(r"^DATA_PATH=(.*)$", proc.stdout, re.M)
    print(f"\nKVIKIO_COMPAT_MODE=OFF -> {data_path}")
    assert data_path.split(" ", 1)[0] in DATA_PATHS
    assert re.search(r"\(.+\)", data_path), "the data path must carry its reason"
    assert "ROUND_TRIP=True" in proc.stdout, out


def test_corrupted_payload_changes_the_checksum(engine, tmp_path):
    blocks = torch.randint(0, 256, (3, 256 << 10), dtype=torch.uint8, device="cuda")
    views = list(blocks)
    torch.cuda.synchronize()
    header_sums = engine.checksums(views)  # what save_blocks puts in each header
    paths, errors = _save(engine, str(tmp_path), views)
    assert errors == [None] * 3
    fd = os.open(paths[1], os.O_RDWR)
    try:
        where = HEADER + 123_457
        os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0x10]), where)
        os.fsync(fd)
    finally:
        os.close(fd)
    back = torch.zeros_like(blocks)
    assert _load(engine, paths, list(back)) == [None] * 3
    got = engine.checksums(list(back))
    assert got[0] == header_sums[0] and got[2] == header_sums[2]
    assert got[1] != header_sums[1]
    assert got[1] == checksum_bytes(_payload(paths[1]))


def test_truncated_file_is_eof_and_bad_fd_fails_alone(engine, tmp_path):
    blocks = torch.randint(0, 256, (2, 128 << 10), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    paths, errors = _save(engine, str(tmp_path), list(blocks))
    assert errors == [None, None]
    os.truncate(paths[0], HEADER + (64 << 10))
    back = torch.zeros_like(blocks)
    errors = _load(engine, paths, list(back))
    assert isinstance(errors[0], EOFError), errors[0]
    assert errors[1] is None and torch.equal(back[1], blocks[1])

    fd = os.open(paths[1], os.O_RDONLY)
    # a number no descriptor can have: a closed one could be reused by the other item's O_DIRECT reopen
    closed = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        errors = engine.read([TransferItem(closed, HEADER, back[0]), TransferItem(fd, HEADER, back[1])])
    finally:
        os.close(fd)
    assert errors[0] is not None and errors[1] is None


def test_host_views_are_refused(engine, tmp_path):
    paths, errors = _save(engine, str(tmp_path), [torch.zeros(8192, dtype=torch.uint8)])
    assert isinstance(errors[0], ValueError)


def test_more_blocks_than_kvikio_keeps_queued_round_trip(engine, tmp_path):
    """40 blocks with 8 I/O threads: KvikIO's path keeps at most 16 in its queue per batch."""
    pool = _pool("uint8", 40, 1, 8192)
    views = [_block_bytes(pool, b) for b in range(pool.shape[0])]
    torch.cuda.synchronize()
    paths, errors = _save(engine, str(tmp_path), views)
    assert errors == [None] * 40
    back = torch.zeros_like(pool)
    assert _load(engine, paths, [_block_bytes(back, b) for b in range(40)]) == [None] * 40
    assert torch.equal(back, pool)


def test_a_deadline_stops_the_writes_not_started(engine, tmp_path):
    """Each path checks the deadline before each write it starts (the staged path also before its
    copy): once it has passed, the rest fail with WriteExpired and their files keep their bytes."""
    from gds_kv_connector.engines.base import WriteExpired

    pool = _pool("uint8", 10, 1, 8192)
    views = [_block_bytes(pool, b) for b in range(10)]
    torch.cuda.synchronize()
    paths, fds = _blank_files(str(tmp_path), "late", views)
    calls = itertools.count()
    try:
        errors = engine.write([TransferItem(fd, HEADER, v) for fd, v in zip(fds, views)], lambda: next(calls) < 3)
    finally:
        for fd in fds:
            os.close(fd)
    written = [i for i, e in enumerate(errors) if e is None]
    # three checks answered yes: the staged path's first is its copy's, and a batch waiting for its
    # queued writes also asks now and then; never more than three writes
    assert 1 <= len(written) <= 3
    assert all(isinstance(errors[i], WriteExpired) for i in range(10) if i not in written)
    for i, path in enumerate(paths):
        want = bytes(views[i].cpu().numpy()) if i in written else bytes(views[i].numel())
        assert _payload(path) == want


def test_a_stop_ends_the_reads_not_started(engine, tmp_path):
    """A load stopped between blocks (cancel_load of its whole offer, or a reset): each path checks
    before each read it starts (the staged path also before each chunk), the rest fail with
    ReadStopped, and their views keep what they held."""
    from gds_kv_connector.engines.base import ReadStopped

    pool = _pool("uint8", 10, 1, 8192)
    views = [_block_bytes(pool, b) for b in range(10)]
    torch.cuda.synchronize()
    paths, errors = _save(engine, str(tmp_path), views)
    assert errors == [None] * 10
    back = torch.full_like(pool, 7)
    fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]
    calls = itertools.count()
    try:
        errors = engine.read([TransferItem(fd, HEADER, _block_bytes(back, b)) for b, fd in enumerate(fds)],
                             lambda: next(calls) < 3)
    finally:
        for fd in fds:
            os.close(fd)
    torch.cuda.synchronize()
    read = [i for i, e in enumerate(errors) if e is None]
    assert 1 <= len(read) <= 3
    assert all(isinstance(errors[i], ReadStopped) for i in range(10) if i not in read)
    for b in range(10):
        want = pool[b] if b in read else torch.full_like(pool[b], 7)
        assert torch.equal(back[b], want), f"block {b}"


def test_views_read_comes_once_the_pages_are_no_longer_needed(engine, tmp_path):
    """A save's ``views_read`` frees its pages (its request is reported finished): whatever the pages
    hold after it must not reach the files.  The staged path calls it after its copy to the stage,
    before its writes; KvikIO's own path reads the pages to its writes' end and leaves it to the caller."""
    pool = _pool("uint8", 6, 1, 8192)
    views = [_block_bytes(pool, b) for b in range(6)]
    want = [bytes(v.cpu().numpy()) for v in views]
    calls: list[int] = []

    def reuse_pages() -> None:  # TensorRT-LLM hands the pages to another request at once
        calls.append(1)
        pool.fill_(0xEE)
        torch.cuda.synchronize()
    torch.cuda.synchronize()
    paths, fds = _blank_files(str(tmp_path), "early", views)
    try:
        errors = engine.write([TransferItem(fd, HEADER, v) for fd, v in zip(fds, views)], None, reuse_pages)
    finally:
        for fd in fds:
            os.close(fd)
    assert errors == [None] * 6 and calls == ([1] if engine.data_path().startswith("staged") else [])
    assert [_payload(p) for p in paths] == want
