"""The staged O_DIRECT file path (engines/staged_files.py) driven with host tensors and memmove in
place of the DMA: layout on disk, chunking, padding, refused O_DIRECT, short files, failures."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import resource
import shutil
import tempfile

import pytest
import torch

from gds_kv_connector.engines.base import TransferItem
from gds_kv_connector.engines.staged_files import StagedFileIo, plan_chunks
from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.format.records import PAGE, align_up

HEADER = 4096


def _to_host(pairs, pitch):
    for addr, view in pairs:
        ctypes.memmove(addr, view.data_ptr(), view.nbytes)


def _from_host(pairs, pitch):
    for addr, view in pairs:
        ctypes.memmove(view.data_ptr(), addr, view.nbytes)


class _Registry:
    def __init__(self):
        self.live: dict[int, int] = {}
        self.calls = 0

    def register(self, addr, nbytes, read_only):
        assert addr % 4096 == 0, "staging must be page-aligned for O_DIRECT"
        self.live[addr] = nbytes
        self.calls += 1

    def unregister(self, addr):
        del self.live[addr]


class _NoDirect(FileOps):
    """A filesystem that refuses O_DIRECT at open, as tmpfs did before Linux 6.6."""

    def open(self, path, flags, mode=0o600):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return super().open(path, flags, mode)


def _io(reg, stage_bytes=1 << 20, ops=None, to_host=_to_host, from_host=_from_host):
    return StagedFileIo(to_host, from_host, reg.register, reg.unregister, io_threads=3, stage_bytes=stage_bytes,
                        ops=ops)


@pytest.fixture(params=["tmp", "shm"])
def directory(request, tmp_path):
    if request.param == "tmp":
        yield str(tmp_path)
        return
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    d = tempfile.mkdtemp(prefix="gdskv-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _create(directory, n, payload):
    """Block files as the pool creates them: header page written, size padded to a page."""
    paths, fds = [], []
    for i in range(n):
        p = os.path.join(directory, f"b{i}")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.pwrite(fd, bytes([i + 1]) * HEADER, 0)
        os.ftruncate(fd, HEADER + align_up(payload, PAGE))
        paths.append(p)
        fds.append(fd)
    return paths, fds


def _write(io, items):
    """Write the items, then close their descriptors (as the pool does before publishing)."""
    try:
        return io.write(items)
    finally:
        for it in items:
            os.close(it.fd)


def _read(paths, io, views):
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        return io.read([TransferItem(fd, HEADER, v) for fd, v in zip(fds, views)])
    finally:
        for fd in fds:
            os.close(fd)


def test_plan_chunks_fills_the_stage_and_grows_for_a_large_block():
    assert plan_chunks([], 1 << 20) == (4096, [])
    pitch, chunks = plan_chunks([5000] * 7, 3 * 8192)
    assert pitch == 8192 and [list(c) for c in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
    pitch, chunks = plan_chunks([10 << 20, 10 << 20], 1 << 20)  # one block per chunk, stage grown
    assert pitch == 10 << 20 and [list(c) for c in chunks] == [[0], [1]]


@pytest.mark.parametrize("payload", [16384, 24000])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "refused"])
def test_round_trip_keeps_header_writes_padding_and_reads_back(directory, payload, direct):
    reg = _Registry()
    io = _io(reg, stage_bytes=3 * align_up(payload, PAGE), ops=None if direct else _NoDirect())
    data = torch.randint(0, 256, (7, payload), dtype=torch.uint8)
    paths, fds = _create(directory, 7, payload)
    try:
        errors = io.write([TransferItem(fd, HEADER, data[i]) for i, fd in enumerate(fds)])
    finally:
        for fd in fds:
            os.close(fd)
    assert errors == [None] * 7
    for i, p in enumerate(paths):
        raw = open(p, "rb").read()
        assert len(raw) == HEADER + align_up(payload, PAGE)
        assert raw[:HEADER] == bytes([i + 1]) * HEADER
        assert raw[HEADER:HEADER + payload] == data[i].numpy().tobytes()
        assert raw[HEADER + payload:] == bytes(align_up(payload, PAGE) - payload)
    back = torch.zeros_like(data)
    assert _read(paths, io, list(back)) == [None] * 7
    assert torch.equal(back, data)
    if not direct:
        assert io.direct_refused == 14  # every file, both directions, through the plain descriptor
    io.close()
    assert reg.live == {}


def test_padding_is_zero_after_a_larger_block_used_the_slot(tmp_path):
    reg = _Registry()
    io = _io(reg)
    big = torch.full((2, 8192), 0xAB, dtype=torch.uint8)
    paths, fds = _create(str(tmp_path), 2, 8192)
    assert io.write([TransferItem(fd, HEADER, big[i]) for i, fd in enumerate(fds)]) == [None, None]
    small = torch.full((1, 5000), 0x11, dtype=torch.uint8)
    path = os.path.join(str(tmp_path), "small")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.ftruncate(fd, HEADER + 8192)
    assert io.write([TransferItem(fd, HEADER, small[0])]) == [None]
    os.close(fd)
    for fd in fds:
        os.close(fd)
    raw = open(path, "rb").read()
    assert raw[HEADER:HEADER + 5000] == b"\x11" * 5000 and raw[HEADER + 5000:] == bytes(8192 - 5000)
    io.close()


def test_a_short_file_fails_alone_and_a_file_ending_in_the_padding_does_not(tmp_path):
    reg = _Registry()
    io = _io(reg)
    payload = 24000
    data = torch.randint(0, 256, (3, payload), dtype=torch.uint8)
    paths, fds = _create(str(tmp_path), 3, payload)
    assert _write(io, [TransferItem(fd, HEADER, data[i]) for i, fd in enumerate(fds)]) == [None] * 3
    os.truncate(paths[0], HEADER + 8192)  # ends before the payload does
    os.truncate(paths[2], HEADER + payload)  # ends after the payload, inside the padding page
    back = torch.zeros_like(data)
    errors = _read(paths, io, list(back))
    assert isinstance(errors[0], EOFError)
    assert errors[1] is None and errors[2] is None
    assert torch.equal(back[1:], data[1:])
    io.close()


def test_a_failed_copy_fails_its_chunk_only(tmp_path):
    reg = _Registry()
    calls = []

    def flaky(pairs, pitch):
        calls.append(len(pairs))
        if len(calls) == 2:
            raise RuntimeError("DMA failed")
        _to_host(pairs, pitch)

    io = _io(reg, stage_bytes=2 * 4096, to_host=flaky)
    data = torch.randint(0, 256, (5, PAGE), dtype=torch.uint8)
    paths, fds = _create(str(tmp_path), 5, PAGE)
    errors = _write(io, [TransferItem(fd, HEADER, data[i]) for i, fd in enumerate(fds)])
    assert calls == [2, 2, 1]
    assert errors[0] is None and errors[1] is None and errors[4] is None
    assert all(isinstance(e, RuntimeError) for e in errors[2:4])
    assert open(paths[4], "rb").read()[HEADER:] == data[4].numpy().tobytes()
    io.close()


def test_a_bad_descriptor_fails_alone_and_the_rest_is_copied_in(tmp_path):
    reg = _Registry()
    io = _io(reg)
    data = torch.randint(0, 256, (2, PAGE), dtype=torch.uint8)
    paths, fds = _create(str(tmp_path), 2, PAGE)
    assert _write(io, [TransferItem(fd, HEADER, data[i]) for i, fd in enumerate(fds)]) == [None, None]
    fd = os.open(paths[1], os.O_RDONLY)
    # a number no descriptor can have (a closed one could be reused by the other item's O_DIRECT reopen)
    never_open = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    back = torch.zeros_like(data)
    try:
        errors = io.read([TransferItem(never_open, HEADER, back[0]), TransferItem(fd, HEADER, back[1])])
    finally:
        os.close(fd)
    assert isinstance(errors[0], OSError) and errors[1] is None
    assert torch.equal(back[1], data[1]) and not back[0].any()
    io.close()


def test_stage_is_per_thread_and_released_at_close(tmp_path):
    import threading

    reg = _Registry()
    io = _io(reg, stage_bytes=8192)
    data = torch.randint(0, 256, (4, PAGE), dtype=torch.uint8)

    def save(i):
        paths, fds = _create(str(tmp_path / f"t{i}"), 2, PAGE)
        io.write([TransferItem(fd, HEADER, data[2 * (i % 2) + k]) for k, fd in enumerate(fds)])
        for fd in fds:
            os.close(fd)

    for i in range(3):
        os.mkdir(tmp_path / f"t{i}")
    threads = [threading.Thread(target=save, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reg.calls == 3 and len(reg.live) == 3
    io.close()
    assert reg.live == {}


def test_stage_size_is_checked():
    with pytest.raises(ValueError, match="stage_bytes"):
        StagedFileIo(_to_host, _from_host, lambda *a: None, lambda a: None, io_threads=1, stage_bytes=100)


class _Counting(FileOps):
    def __init__(self):
        self.pwrites: list[tuple[int, int]] = []  # (offset, length)
        self.preads: list[tuple[int, int]] = []

    def pwrite(self, fd, data, offset):
        self.pwrites.append((offset, len(data)))
        return super().pwrite(fd, data, offset)

    def preadv(self, fd, buf, offset):
        self.preads.append((offset, len(buf)))
        return super().preadv(fd, buf, offset)


@pytest.mark.parametrize("payload", [16384, 24000])
def test_header_and_payload_move_in_one_io_per_file(tmp_path, payload):
    reg = _Registry()
    ops = _Counting()
    io = _io(reg, ops=ops)
    data = torch.randint(0, 256, (3, payload), dtype=torch.uint8)
    paths, fds = [], []
    for i in range(3):  # as pool.create_tmp(key, None) leaves them: size only
        p = os.path.join(str(tmp_path), f"b{i}")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(fd, HEADER + align_up(payload, PAGE))
        paths.append(p)
        fds.append(fd)
    headers = [bytes([0x40 + i]) * HEADER for i in range(3)]
    errors = _write(io, [TransferItem(fd, HEADER, data[i], headers[i]) for i, fd in enumerate(fds)])
    assert errors == [None] * 3
    assert sorted(ops.pwrites) == [(0, HEADER + align_up(payload, PAGE))] * 3
    for i, p in enumerate(paths):
        raw = open(p, "rb").read()
        assert raw == headers[i] + data[i].numpy().tobytes() + bytes(align_up(payload, PAGE) - payload)
    back = torch.zeros_like(data)
    got = [bytearray(HEADER) for _ in range(3)]
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        errors = io.read([TransferItem(fd, HEADER, back[i], got[i]) for i, fd in enumerate(fds)])
    finally:
        for fd in fds:
            os.close(fd)
    assert errors == [None] * 3
    assert sorted(ops.preads) == [(0, HEADER + align_up(payload, PAGE))] * 3
    assert [bytes(g) for g in got] == headers and torch.equal(back, data)
    io.close()


def test_a_header_that_does_not_fill_the_pages_before_the_payload_fails_its_item(tmp_path):
    reg = _Registry()
    io = _io(reg)
    data = torch.randint(0, 256, (2, PAGE), dtype=torch.uint8)
    paths, fds = _create(str(tmp_path), 2, PAGE)
    errors = _write(io, [TransferItem(fds[0], HEADER, data[0], b"x" * 100), TransferItem(fds[1], HEADER, data[1])])
    assert isinstance(errors[0], ValueError) and errors[1] is None
    assert open(paths[1], "rb").read()[HEADER:] == data[1].numpy().tobytes()
    io.close()


def test_plan_runs_joins_adjacent_slots_of_one_file_up_to_the_io_limit():
    from gds_kv_connector.engines.staged_files import plan_runs

    pitch = 3 * PAGE
    # four adjacent slots of fd 5, then a gap, then fd 6, then fd 6 again adjacent
    spans = [(5, 0, pitch), (5, pitch, pitch), (5, 2 * pitch, pitch), (5, 3 * pitch, pitch),
             (5, 5 * pitch, pitch), (6, 6 * pitch, pitch), (6, 7 * pitch, pitch)]
    assert plan_runs(spans, pitch, 1 << 30) == [(0, 4), (4, 5), (5, 7)]
    assert plan_runs(spans, pitch, 2 * pitch) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    assert plan_runs(spans, pitch, 1) == [(k, k + 1) for k in range(7)]  # a slot larger than the limit goes alone
    # a slot shorter than the pitch (a smaller block) ends its run: the next one is not beside it in the stage
    assert plan_runs([(5, 0, PAGE), (5, PAGE, pitch)], pitch, 1 << 30) == [(0, 1), (1, 2)]
    assert plan_runs([], pitch, 1 << 30) == []


@pytest.mark.parametrize("direct", [True, False])
def test_adjacent_slots_of_one_file_move_in_one_io_each_way(tmp_path, direct):
    """Arena slabs on disk: slots saved together are written and read with one I/O per run,
    each slot keeping its own header and payload at slot * slot_bytes."""
    reg = _Registry()
    ops = _Counting() if direct else type("_CountingNoDirect", (_Counting, _NoDirect), {})()
    payload = 2 * PAGE
    slot = HEADER + payload
    io = StagedFileIo(_to_host, _from_host, reg.register, reg.unregister, io_threads=3, stage_bytes=1 << 20,
                      ops=ops, max_io_bytes=3 * slot)
    n = 7
    path = os.path.join(str(tmp_path), "slab")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 10 * slot)
        data = torch.randint(0, 256, (n, payload), dtype=torch.uint8)
        headers = [bytes([0x60 + i]) * HEADER for i in range(n)]
        slots = [1, 2, 3, 4, 5, 8, 9]  # a run of five (cut to three + two by the limit), a gap, a run of two
        errors = io.write([TransferItem(fd, s * slot + HEADER, data[i], headers[i]) for i, s in enumerate(slots)])
        assert errors == [None] * n
        assert sorted(ops.pwrites) == [(1 * slot, 3 * slot), (4 * slot, 2 * slot), (8 * slot, 2 * slot)]
        raw = open(path, "rb").read()
        for i, s in enumerate(slots):
            assert raw[s * slot:(s + 1) * slot] == headers[i] + data[i].numpy().tobytes()
        assert raw[:slot] == bytes(slot) and raw[6 * slot:8 * slot] == bytes(2 * slot)
        back = torch.zeros_like(data)
        got = [bytearray(HEADER) for _ in range(n)]
        errors = io.read([TransferItem(fd, s * slot + HEADER, back[i], got[i]) for i, s in enumerate(slots)])
        assert errors == [None] * n
        assert sorted(ops.preads) == [(1 * slot, 3 * slot), (4 * slot, 2 * slot), (8 * slot, 2 * slot)]
        assert [bytes(g) for g in got] == headers and torch.equal(back, data)
    finally:
        os.close(fd)
        io.close()


def test_a_run_that_reads_past_the_end_fails_every_slot_of_the_run_only(tmp_path):
    reg = _Registry()
    payload = PAGE
    slot = HEADER + payload
    io = StagedFileIo(_to_host, _from_host, reg.register, reg.unregister, io_threads=2, stage_bytes=1 << 20,
                      max_io_bytes=2 * slot)
    path = os.path.join(str(tmp_path), "slab")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 3 * slot)  # slots 0-2 exist; slot 3 does not
        views = torch.zeros((4, payload), dtype=torch.uint8)
        errors = io.read([TransferItem(fd, s * slot + HEADER, views[s], bytearray(HEADER)) for s in range(4)])
        assert errors[0] is None and errors[1] is None  # run (0, 1)
        assert isinstance(errors[2], EOFError) and errors[3] is errors[2]  # run (2, 3) ends short
    finally:
        os.close(fd)
        io.close()


class _ShortFirstRead(FileOps):
    """The first read stops after ``count`` bytes of a longer request (the rest of the buffer
    scribbled over, so it must be read again); every read is noted as (O_DIRECT?, offset, length)."""

    def __init__(self, count):
        self.count = count
        self.reads: list[tuple[bool, int, int]] = []

    def preadv(self, fd, buf, offset):
        self.reads.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, len(buf)))
        n = super().preadv(fd, buf, offset)
        if len(self.reads) > 1 or n <= self.count:
            return n
        buf[self.count:n] = b"\xee" * (n - self.count)
        return self.count


@pytest.mark.parametrize("short", [PAGE + 1000, 2 * PAGE], ids=["inside_a_page", "whole_pages"])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "refused"])
def test_a_short_read_before_the_end_is_read_on(tmp_path, short, direct):
    """A short count is not the end of the file (a plain descriptor may return one anywhere): the
    rest is read, on O_DIRECT while the position stays page-aligned, else on the plain descriptor."""
    reg = _Registry()
    ops = _ShortFirstRead(short) if direct else type("_ShortNoDirect", (_ShortFirstRead, _NoDirect), {})(short)
    io = _io(reg, ops=ops)
    payload = 24000
    data = torch.randint(0, 256, (1, payload), dtype=torch.uint8)
    paths, fds = _create(str(tmp_path), 1, payload)
    assert _write(io, [TransferItem(fds[0], HEADER, data[0])]) == [None]
    back, got = torch.zeros_like(data), bytearray(HEADER)
    fd = os.open(paths[0], os.O_RDONLY)
    try:
        assert io.read([TransferItem(fd, HEADER, back[0], got)]) == [None]
    finally:
        os.close(fd)
    assert torch.equal(back, data) and got == bytes([1]) * HEADER
    size = HEADER + align_up(payload, PAGE)
    assert ops.reads == [(direct, 0, size), (direct and short % PAGE == 0, short, size - short)]
    io.close()


def test_an_error_kept_by_the_caller_does_not_pin_the_stage(tmp_path):
    """A failed read's error travels up to the load's failure message; its traceback held the
    frame of the read that had a slice of the stage, and the stage could then not be replaced
    by a larger one (BufferError) nor closed."""
    from tests.support.faults import FaultyFileOps

    ops = FaultyFileOps()
    io = _io(_Registry(), stage_bytes=4 * PAGE, ops=ops)
    paths, fds = _create(str(tmp_path), 2, PAGE)
    for fd in fds:
        os.close(fd)
    ops.add("preadv", "eio", count=2)
    kept = _read(paths, io, [torch.zeros(PAGE, dtype=torch.uint8) for _ in paths])
    assert all(isinstance(e, OSError) for e in kept)
    os.makedirs(tmp_path / "big")
    big, bfds = _create(str(tmp_path / "big"), 1, 16 * PAGE)
    for fd in bfds:
        os.close(fd)
    assert _read(big, io, [torch.zeros(16 * PAGE, dtype=torch.uint8)]) == [None]  # the stage grew
    io.close()
    assert kept  # still alive here
