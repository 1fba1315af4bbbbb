"""The C loops (csrc/native.c) against the Python definitions they replace, byte for byte.

Every test runs twice: with the extension (where it was built) and with its Python fallback.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import random
import shutil
import time

import pytest

from gds_kv_connector.format import native
from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.format.keys import chain_from_tokens, extend_chain, token_array
from gds_kv_connector.format.records import HEADER_FIELDS_SIZE, HEADER_SIZE, BlockHeader, parse_header

FP = hashlib.sha256(b"native-test").digest()


def test_the_extension_is_built_where_a_compiler_is():
    """CI and the README install build it; a missing build would silently cost the speed."""
    if not (shutil.which("cc") or shutil.which("gcc")) or not os.path.exists("/usr/include/openssl/sha.h"):
        pytest.skip("no C compiler or OpenSSL headers here: the Python loops are expected")
    assert native.BUILT, "a C compiler and OpenSSL headers are present but gds_kv_connector._native was not built"


@pytest.mark.parametrize("tpb", [1, 16, 32])
def test_chain_keys_equal_the_definition(native_impl, tpb):
    rng = random.Random(tpb)
    tokens = [rng.randrange(-2**63, 2**63) for _ in range(1100 * tpb + 5)]
    prev = hashlib.sha256(b"seed").digest()
    # the C loop releases the GIL from 64 blocks on and keeps it below; from 512 blocks it hashes on a
    # second thread while it converts the tokens
    for start, n in [(0, 20), (3 * tpb, 17), (5, 20 - 1), (0, 0), (0, 80),
                     (0, 512), (3, 1100), (5 * tpb, 700), (0, 1023)]:
        want = extend_chain(prev, token_array(tokens, start, start + n * tpb), tpb, 0, n)
        assert chain_from_tokens(prev, tokens, start, tpb, n) == want
        assert chain_from_tokens(prev, tuple(tokens), start, tpb, n) == want


def test_chain_keys_reject_bad_input():
    if not native.BUILT:
        pytest.skip("the C extension is not built here")
    prev = bytes(32)
    with pytest.raises(ValueError, match="need more than"):
        native.chain_keys(prev, [1] * 31, 0, 16, 2)
    with pytest.raises(ValueError, match="prev key"):
        native.chain_keys(b"short", [1] * 32, 0, 16, 2)
    with pytest.raises(TypeError):
        native.chain_keys(prev, [1] * 31 + ["x"], 0, 16, 2)
    with pytest.raises(OverflowError):
        native.chain_keys(prev, [1] * 31 + [2**63], 0, 16, 2)


def test_a_bad_token_deep_in_a_long_chain_raises_and_stops_the_hasher():
    if not native.BUILT:
        pytest.skip("the C extension is not built here")
    for at in (0, 15, 16, 9000, 20 * 1000 - 1):  # before, at and after a publication, and the very last
        tokens = [1] * (20 * 1000)
        tokens[at] = "x"
        with pytest.raises(TypeError):
            native.chain_keys(bytes(32), tokens, 0, 20, 1000)
    good = [7] * (20 * 1000)
    assert native.chain_keys(bytes(32), good, 0, 20, 1000) == extend_chain(
        bytes(32), token_array(good, 0, 20 * 1000), 20, 0, 1000)


class Slots:
    """A few 4 KiB-headed slots in ordinary memory, addressed as the arena addresses its slabs."""

    def __init__(self, n: int, slot_bytes: int = 2 * HEADER_SIZE) -> None:
        self.buf = (ctypes.c_char * (n * slot_bytes))()
        self.addrs = [ctypes.addressof(self.buf) + i * slot_bytes for i in range(n)]

    def header(self, i: int) -> bytes:
        return ctypes.string_at(self.addrs[i], HEADER_SIZE)


def _write(s: Slots, keys, sums, created):
    parents = [hashlib.sha256(k).digest() for k in keys]
    native.write_headers(s.addrs, FP, keys, parents, sums, 12345, 1, 32, created)
    return parents


@pytest.mark.parametrize("n", [5, 600])
def test_written_headers_are_the_packed_headers_and_check_back(native_impl, n):
    s = Slots(n)
    keys = [hashlib.sha256(i.to_bytes(2, "little")).digest() for i in range(n)]
    sums = [random.Random(i).randrange(2**64) for i in range(n)]
    created = time.time_ns()
    parents = _write(s, keys, sums, created)
    for i in range(n):
        want = BlockHeader(FP, keys[i], 12345, sums[i], 1, 32, created, parents[i])
        assert s.header(i) == want.pack()
        assert parse_header(s.header(i), fingerprint=FP, key=keys[i], payload_len=12345) == want
    fields, got, bad, why = native.check_headers(s.addrs, FP, keys, [created] * n, 12345)
    assert (got, bad, why) == (sums, -1, None)
    assert fields == b"".join(s.header(i)[:HEADER_FIELDS_SIZE] for i in range(n))
    assert native.first_changed(s.addrs, fields) == -1
    native.clear_headers(s.addrs[3:4] if n < 10 else s.addrs[3:])
    assert native.first_changed(s.addrs, fields) == 3
    fields, got, bad, why = native.check_headers(s.addrs, FP, keys, [created] * n, 12345)
    assert (got, bad) == (sums[:3], 3) and "magic" in why


@pytest.mark.parametrize("damage, reason", [
    (lambda h: h.__setitem__(slice(0, 1), b"X"), "magic"),
    (lambda h: h.__setitem__(slice(60, 61), bytes([h[60] ^ 1])), "checksum mismatch"),
    (lambda h: h.__setitem__(slice(4000, 4001), b"\1"), "reserved header tail"),
])
def test_a_damaged_header_stops_the_check_at_its_slot(native_impl, damage, reason):
    n = 4
    s = Slots(n)
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(n)]
    created = 77
    _write(s, keys, [1, 2, 3, 4], created)
    raw = bytearray(s.header(2))
    damage(raw)
    ctypes.memmove(s.addrs[2], bytes(raw), HEADER_SIZE)
    fields, got, bad, why = native.check_headers(s.addrs, FP, keys, [created] * n, 12345)
    assert bad == 2 and reason in why
    assert got == [1, 2] and len(fields) == 2 * HEADER_FIELDS_SIZE


def test_a_reused_slot_is_told_apart_from_its_reference(native_impl):
    s = Slots(3)
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    _write(s, keys, [1, 2, 3], 50)
    other = [keys[0], hashlib.sha256(b"other").digest(), keys[2]]
    _, got, bad, why = native.check_headers(s.addrs, FP, other, [50] * 3, 12345)
    assert (got, bad) == ([1], 1) and "another key" in why
    assert "newer record" in native.check_headers(s.addrs, FP, keys, [50, 50, 49], 12345)[3]
    assert "fingerprint" in native.check_headers(s.addrs, bytes(32), keys, [50] * 3, 12345)[3]
    assert "payload_len" in native.check_headers(s.addrs, FP, keys, [50] * 3, 4096)[3]


def _key_dirs(root):
    """256 directories as pool._key_dirs names them; only a few exist, so ENOENT can be tested."""
    dirs = tuple(str(root / f"{b:02x}") for b in range(256))
    for b in (0x00, 0x7f, 0xff):
        os.mkdir(dirs[b])
    return dirs


def test_link_keys_reports_each_key(native_impl, tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"ref")
    dirs = _key_dirs(tmp_path)
    keys = [bytes([0x00]) + bytes(range(31)), bytes([0x7f]) * 32, bytes([0x10]) * 32, bytes([0xff]) + b"\xab" * 31]
    names = [f"{dirs[k[0]]}/{k.hex()}.blk" for k in keys]
    with open(names[1], "wb") as f:
        f.write(b"other")
    errs = FileOps().link_keys(str(src), dirs, keys, ".blk")
    assert [0 if e is None else e.errno for e in errs] == [0, errno.EEXIST, errno.ENOENT, 0]
    assert [None if e is None else e.filename2 for e in errs] == [None, names[1], names[2], None]
    assert os.stat(names[0]).st_ino == os.stat(names[3]).st_ino == os.stat(src).st_ino
    assert open(names[1], "rb").read() == b"other"


def test_link_keys_rejects_bad_arguments(tmp_path):
    if not native.BUILT:
        pytest.skip("the C extension is not built here")
    dirs = _key_dirs(tmp_path)
    with pytest.raises(TypeError):
        native.link_keys(str(tmp_path / "src"), dirs[:255], [bytes(32)], ".blk")
    with pytest.raises(TypeError):
        native.link_keys(str(tmp_path / "src"), dirs, [bytes(31)], ".blk")


def test_file_ops_link_keys_goes_through_an_overridden_link(tmp_path):
    seen = []

    class Counting(FileOps):
        def link(self, src, dst):
            seen.append(dst)
            super().link(src, dst)

    src = tmp_path / "src"
    src.write_bytes(b"ref")
    dirs = _key_dirs(tmp_path)
    key, other = bytes([0x7f]) * 32, bytes(32)
    name = f"{dirs[0x7f]}/{key.hex()}.blk"
    errs = Counting().link_keys(str(src), dirs, [key, key], ".blk")
    assert seen == [name] * 2
    assert errs[0] is None and isinstance(errs[1], FileExistsError)
    errs = FileOps().link_keys(str(src), dirs, [other, key], ".blk")
    assert errs[0] is None and isinstance(errs[1], FileExistsError) and errs[1].filename2 == name


def test_present_run_stops_at_the_first_key_without_a_regular_file(native_impl, tmp_path):
    dirs = _key_dirs(tmp_path)  # keys under 0x00, 0x7f and 0xff, the directories that exist
    rng = random.Random(7)
    keys = [bytes([rng.choice((0x00, 0x7f, 0xff))]) + rng.randbytes(31) for _ in range(20)]
    for i, k in enumerate(keys[:12]):  # 12 files: past the 8 stats the C loop makes holding the GIL
        with open(f"{dirs[k[0]]}/{k.hex()}.blk", "wb") as f:
            f.write(b"x" * (i + 1))
    ops = FileOps()
    assert ops.present_run(dirs, keys, 0, ".blk") == list(range(1, 13))
    assert ops.present_run(dirs, keys, 10, ".blk") == [11, 12]
    assert ops.present_run(dirs, keys, 12, ".blk") == []
    assert ops.present_run(dirs, keys, 20, ".blk") == []
    os.mkdir(f"{dirs[keys[3][0]]}/{keys[13].hex()}.other")  # not a file of this suffix: ignored
    os.remove(f"{dirs[keys[5][0]]}/{keys[5].hex()}.blk")
    os.mkdir(f"{dirs[keys[5][0]]}/{keys[5].hex()}.blk")  # a directory under a key's name ends the run
    assert ops.present_run(dirs, keys, 0, ".blk") == [1, 2, 3, 4, 5]
    os.symlink(f"{dirs[keys[0][0]]}/{keys[0].hex()}.blk", f"{dirs[keys[12][0]]}/{keys[12].hex()}.blk")
    assert ops.present_run(dirs, keys, 6, ".blk") == [7, 8, 9, 10, 11, 12]  # a link is never followed


def test_present_run_rejects_bad_arguments(tmp_path):
    if not native.BUILT:
        pytest.skip("the C extension is not built here")
    dirs = _key_dirs(tmp_path)
    with pytest.raises(TypeError):
        native.present_run(dirs[:255], [bytes(32)], 0, ".blk")
    with pytest.raises(TypeError):
        native.present_run(dirs, [bytes(32), bytes(31)], 0, ".blk")
    with pytest.raises(ValueError):
        native.present_run(dirs, [bytes(32)], 2, ".blk")


def test_file_ops_present_run_goes_through_an_overridden_stat(tmp_path):
    seen = []

    class Counting(FileOps):
        def stat(self, path):
            seen.append(path)
            return super().stat(path)

    dirs = _key_dirs(tmp_path)
    key, missing = bytes([0x7f]) * 32, bytes(32)
    name = f"{dirs[0x7f]}/{key.hex()}.blk"
    with open(name, "wb") as f:
        f.write(b"abc")
    assert Counting().present_run(dirs, [key, missing, key], 0, ".blk") == [3]
    assert seen == [name, f"{dirs[0]}/{missing.hex()}.blk"]


def test_present_run_splits_a_long_run_and_stops_at_its_first_gap(native_impl, tmp_path):
    """Past its first 8 stats the C loop splits the rest into spans of 256 keys or more on threads;
    the answer is still the prefix up to the first key without a regular file, wherever it falls."""
    dirs = _key_dirs(tmp_path)
    rng = random.Random(11)
    keys = [bytes([rng.choice((0x00, 0x7f, 0xff))]) + rng.randbytes(31) for _ in range(1300)]
    names = [f"{dirs[k[0]]}/{k.hex()}.blk" for k in keys]
    for i, name in enumerate(names):
        with open(name, "wb") as f:
            f.truncate(i % 7)
    ops = FileOps()
    assert ops.present_run(dirs, keys, 0, ".blk") == [i % 7 for i in range(1300)]
    for gap in (1299, 1000, 520, 9, 8):  # in the last span, a middle one, the first span, its first key
        os.remove(names[gap])
        os.mkdir(names[gap])  # a directory under the key's name: not a block file
        assert ops.present_run(dirs, keys, 0, ".blk") == [i % 7 for i in range(gap)]
    assert ops.present_run(dirs, keys, 10, ".blk") == [i % 7 for i in range(10, 520)]


@pytest.mark.parametrize("blocks", [1, 40, 1300])
def test_chain_present_equals_chain_keys_then_present_run(tmp_path, blocks):
    """The fused call's keys are chain_keys' and its sizes present_run's, wherever the first gap
    falls: at the first key (a prompt not in the pool), inside the first chunk of 16, or in a
    chunk taken by one of the other stat threads; a directory or a link under a key's name ends
    the run as in present_run."""
    if not native.BUILT:
        pytest.skip("the C extension is not built here")
    from gds_kv_connector import _native as lib
    dirs = tuple(str(tmp_path / f"{b:02x}") for b in range(256))
    for d in dirs:
        os.mkdir(d)
    rng = random.Random(blocks)
    tokens = [rng.randrange(1 << 40) for _ in range(blocks * 4 + 3)]
    seed = rng.randbytes(32)
    keys = lib.chain_keys(seed, tokens, 3, 4, blocks)
    names = [f"{dirs[k[0]]}/{k.hex()}.blk" for k in keys]
    for i, name in enumerate(names):
        with open(name, "wb") as f:
            f.truncate(i % 5)

    def both():
        fused = lib.chain_present(seed, tokens, 3, 4, blocks, dirs, ".blk")
        return fused, (keys, lib.present_run(dirs, keys, 0, ".blk"))

    fused, plain = both()
    assert fused == plain and len(fused[1]) == blocks
    for gap in sorted({blocks - 1, blocks // 2, 17, 15, 0}, reverse=True):
        if gap >= blocks:
            continue
        os.remove(names[gap])
        (os.mkdir if gap % 2 else os.symlink)(*((names[gap],) if gap % 2 else (names[0], names[gap])))
        fused, plain = both()
        assert fused == plain and len(fused[1]) == gap
    with pytest.raises(ValueError):  # too few tokens, as chain_keys
        lib.chain_present(seed, tokens, 4, 4, blocks, dirs, ".blk")
    with pytest.raises(TypeError):
        lib.chain_present(seed, tokens, 3, 4, blocks, dirs[:255], ".blk")
    with pytest.raises(TypeError):  # a token that is not an int: the hasher and stat threads stop
        lib.chain_present(seed, tokens[:1] + ["x"] + tokens[2:], 0, 4, blocks, dirs, ".blk")


_MAGIC_LAST_CHILD = r"""
import ctypes, hashlib, mmap, sys
from gds_kv_connector.format import native
if sys.argv[2] == "python":
    native._lib = None
libc = ctypes.CDLL(None, use_errno=True)
page = mmap.PAGESIZE
with open(sys.argv[1], "r+b") as fh:
    m = mmap.mmap(fh.fileno(), 2 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
addr = base + page - 8  # the magic ends the first page, the other fields start the second
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(base, page, mmap.PROT_READ) == 0
key = hashlib.sha256(b"k").digest()
native.write_headers([addr], hashlib.sha256(b"native-test").digest(), [key], [key], [5], 12345, 1, 32, 9)
"""


def test_a_slot_header_s_magic_is_written_after_its_other_fields(native_impl, tmp_path):
    """A header written magic first was for a moment the slot's previous header again over the new
    payload (old and new share their first 32 bytes), which a reader's after-copy check took for
    unchanged.  The magic is put on a read-only page: the write faults there, and the fields on the
    next page must already be written."""
    import mmap
    import signal
    import subprocess
    import sys

    path = tmp_path / "slot"
    path.write_bytes(bytes(2 * mmap.PAGESIZE))
    child = subprocess.run([sys.executable, "-c", _MAGIC_LAST_CHILD, str(path),
                            "c" if native._lib is not None else "python"], capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGSEGV, child.stderr.decode()[-2000:]
    written = path.read_bytes()[mmap.PAGESIZE:mmap.PAGESIZE + HEADER_FIELDS_SIZE - 8]
    key = hashlib.sha256(b"k").digest()
    assert written == BlockHeader(FP, key, 12345, 5, 1, 32, 9, key).pack_fields()[8:]
