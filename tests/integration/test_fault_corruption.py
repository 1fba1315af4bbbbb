"""Every kind of damaged or planted file is detected, never loaded, and taken out of lookups.

Pool files come from a directory other processes (and other users of a group) write, so the
loader must treat them as untrusted: a corrupted byte anywhere that matters, a short file, a
well-formed header of the wrong identity, a file renamed to another key's name, or a symlink
planted at a key's name.  Each case must raise LoadFailure from the store's pin/load, leave the
destination views' contents irrelevant (the load is reported failed), move the file to the
quarantine directory (a symlink is moved itself, never followed), and make contains() /
count_present() stop reporting the key.  Also: paths are formed only from 32-byte keys, and files
and directories get the documented permissions.
"""

from __future__ import annotations

import os
import stat
import struct
import time
import zlib

import pytest

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402
from gds_kv_connector.store.base import LoadFailure, open_store  # noqa: E402
from gds_kv_connector.engines.posix import PosixEngine  # noqa: E402
from gds_kv_connector.format.layout import LAYOUT_DIR, QUARANTINE_DIR  # noqa: E402
from gds_kv_connector.format.records import CRC_OFFSET, HEADER_SIZE, _FIXED  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]

# Byte ranges of the header fields (struct "<8sII32s32sQQIIQII32s" then the crc at 152).
FIELDS = {"magic": (0, 8), "version": (8, 12), "header_size": (12, 16), "fingerprint": (16, 48),
          "key": (48, 80), "payload_len": (80, 88), "checksum": (88, 96), "checksum_algo": (96, 100),
          "tokens_per_block": (100, 104), "created_ns": (104, 112), "flags": (112, 116),
          "reserved": (116, 120), "parent_key": (120, 152), "header_crc": (152, 156),
          "reserved_tail": (156, HEADER_SIZE)}
assert _FIXED.size == CRC_OFFSET == 152


@pytest.fixture
def env(tmp_path):
    pool = fh.make_pool(str(tmp_path / "pool"), index_ttl_s=0.0)
    engine = PosixEngine(io_threads=2)
    kv = fh.make_kv(4)
    yield pool, engine, kv
    engine.close()


def _save(pool, engine, kv, key):
    out = open_store(pool, engine).save([key], [b""], [fh.fill(kv, 0, key)])
    assert out.published == 1
    return pool.path_for(key)


def _rewrite(path, fn):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data = fn(data)
    os.chmod(path, 0o600)
    with open(path, "wb") as f:
        f.write(data)


def _flip(offset, bit=0):
    def fn(data):
        data[offset] ^= 1 << bit
        return data
    return fn


def _header_field(name, value_bytes):
    """Replace a header field and recompute the header CRC: a well-formed header of the wrong identity."""
    lo, hi = FIELDS[name]

    def fn(data):
        data[lo:hi] = value_bytes
        data[CRC_OFFSET:CRC_OFFSET + 4] = struct.pack("<I", zlib.crc32(bytes(data[:CRC_OFFSET])))
        return data
    return fn


def _quarantined(pool):
    qdir = os.path.join(pool.roots[0], LAYOUT_DIR, QUARANTINE_DIR)
    return sorted(os.listdir(qdir))


def _expect_rejected(pool, engine, kv, key, *, via_load=True):
    """The key must fail to load, be quarantined and vanish from lookups."""
    before = len(_quarantined(pool))
    with pytest.raises(LoadFailure) as info:
        pins = open_store(pool).pin([key])
        try:
            open_store(pool, engine).load(pins, [kv.block_view(1)], verify=True, retries=1,
                        deadline=time.monotonic() + 10)
        finally:
            for p in pins:
                pool.unpin(p)
    assert info.value.key == key
    assert not os.path.lexists(pool.path_for(key)), "the bad file is still at the key's name"
    assert len(_quarantined(pool)) == before + 1, "the bad file was not moved to the quarantine directory"
    assert not pool.contains(key)
    assert pool.count_present([key]) == 0
    return info.value


CASES = [(f"bitflip_{name}", (lo + hi) // 2) for name, (lo, hi) in FIELDS.items()] + [
    ("bitflip_payload_first", HEADER_SIZE), ("bitflip_payload_middle", HEADER_SIZE + fh.PAYLOAD_LEN // 2),
    ("bitflip_payload_last", HEADER_SIZE + fh.PAYLOAD_LEN - 1)]


@pytest.mark.parametrize("case,offset", CASES, ids=[c for c, _ in CASES])
def test_bit_flip_detected(env, case, offset):
    pool, engine, kv = env
    key = fh.key_of("flip", case)
    path = _save(pool, engine, kv, key)
    bit = offset % 8
    _rewrite(path, _flip(offset, bit))
    assert pool.contains(key), "a same-size corrupt file still looks present until it is read"
    exc = _expect_rejected(pool, engine, kv, key)
    fh.record("corruption", trials=1, injected=1, detected=1)
    assert exc.path == path


IDENTITY = {
    "wrong_magic": ("magic", b"GDSKVBLX"),
    "wrong_version": ("version", struct.pack("<I", 2)),
    "wrong_header_size": ("header_size", struct.pack("<I", 8192)),
    "wrong_fingerprint": ("fingerprint", b"\x01" * 32),
    "wrong_payload_len": ("payload_len", struct.pack("<Q", fh.PAYLOAD_LEN - 8)),
    "wrong_algo": ("checksum_algo", struct.pack("<I", 7)),
    "nonzero_flags": ("flags", struct.pack("<I", 1)),
    "zero_tokens_per_block": ("tokens_per_block", struct.pack("<I", 0)),
}


@pytest.mark.parametrize("case", sorted(IDENTITY))
def test_wellformed_header_of_wrong_identity_detected(env, case):
    """The header CRC is recomputed, so only the field checks themselves can catch these."""
    pool, engine, kv = env
    key = fh.key_of("identity", case)
    path = _save(pool, engine, kv, key)
    _rewrite(path, _header_field(*IDENTITY[case]))
    exc = _expect_rejected(pool, engine, kv, key)
    assert "bad header" in exc.reason
    fh.record("corruption", trials=1, injected=1, detected=1)


@pytest.mark.parametrize("size", [0, 1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + fh.PAYLOAD_LEN - 1,
                                  "plus_one"])
def test_truncated_or_extended_file_detected(env, size):
    pool, engine, kv = env
    key = fh.key_of("trunc", size)
    path = _save(pool, engine, kv, key)
    new_size = pool.file_size + 1 if size == "plus_one" else size
    os.truncate(path, new_size)
    assert not pool.contains(key), "a file of the wrong size must not be reported present"
    _expect_rejected(pool, engine, kv, key)
    fh.record("corruption", trials=1, injected=1, detected=1)


def test_file_renamed_to_another_key_detected(env):
    pool, engine, kv = env
    a, b = fh.key_of("rename", "a"), fh.key_of("rename", "b")
    pa = _save(pool, engine, kv, a)
    os.makedirs(os.path.dirname(pool.path_for(b)), exist_ok=True)
    os.rename(pa, pool.path_for(b))
    exc = _expect_rejected(pool, engine, kv, b)
    assert "key in header differs" in exc.reason
    fh.record("corruption", trials=1, injected=1, detected=1)


def test_file_truncated_after_pin_detected(env):
    """Shrinking a file between the size check and the read: EOF is a failure, never short data."""
    pool, engine, kv = env
    key = fh.key_of("shrink-after-pin")
    path = _save(pool, engine, kv, key)
    pins = open_store(pool).pin([key])
    os.truncate(path, HEADER_SIZE + 100)
    try:
        with pytest.raises(LoadFailure, match="file ended"):
            open_store(pool, engine).load(pins, [kv.block_view(1)], verify=True, retries=1,
                        deadline=time.monotonic() + 10)
    finally:
        pool.unpin(pins[0])
    assert not pool.contains(key) and not os.path.lexists(path)
    fh.record("corruption", trials=1, injected=1, detected=1)


@pytest.mark.parametrize("target", ["other_block", "/etc/passwd", "dangling", "loop"])
def test_symlink_at_key_path_never_followed(env, target):
    pool, engine, kv = env
    key = fh.key_of("symlink", target)
    other = fh.key_of("symlink-target", target)
    other_path = _save(pool, engine, kv, other)
    path = pool.path_for(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    dest = {"other_block": other_path, "/etc/passwd": "/etc/passwd", "dangling": path + ".nowhere",
            "loop": path}[target]
    os.symlink(dest, path)
    assert not pool.contains(key), "a symlink must never count as a published block"
    exc = _expect_rejected(pool, engine, kv, key)
    assert "symbolic link" in exc.reason
    q = os.path.join(pool.roots[0], LAYOUT_DIR, QUARANTINE_DIR)
    moved = [n for n in os.listdir(q) if n.startswith(key.hex())]
    assert len(moved) == 1 and os.path.islink(os.path.join(q, moved[0])), "the link itself is quarantined"
    # The target was neither read into the pool nor touched.
    assert os.path.isfile(other_path) and pool.contains(other)
    if target == "other_block":
        fh.verify_file(other_path)
    # The key can be published again now that the planted link is gone.
    assert open_store(pool, engine).save([key], [b""], [fh.fill(kv, 0, key)]).published == 1
    fh.load_and_compare(pool, engine, kv, [key], first_block=2)
    fh.record("corruption", trials=1, injected=1, detected=1)


def test_fifo_at_key_path_does_not_block(env):
    """open(2) of a FIFO without O_NONBLOCK would hang the transfer thread forever."""
    pool, engine, kv = env
    key = fh.key_of("fifo")
    path = pool.path_for(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    _expect_rejected(pool, engine, kv, key)
    fh.record("corruption", trials=1, injected=1, detected=1)


def test_unverified_load_still_checks_header(env):
    """verify=False skips the payload checksum, never the identity checks."""
    pool, engine, kv = env
    key = fh.key_of("noverify")
    path = _save(pool, engine, kv, key)
    _rewrite(path, _flip(FIELDS["key"][0]))
    pins = open_store(pool).pin([key])
    try:
        with pytest.raises(LoadFailure):
            open_store(pool, engine).load(pins, [kv.block_view(1)], verify=False, retries=0,
                        deadline=time.monotonic() + 10)
    finally:
        pool.unpin(pins[0])
    assert not pool.contains(key)


def test_corrupt_block_in_batch_releases_all_pins(env):
    """pin_blocks is all-or-nothing: a bad file late in the batch closes the earlier descriptors."""
    pool, engine, kv = env
    keys = [fh.key_of("batch", i) for i in range(3)]
    for k in keys:
        _save(pool, engine, kv, k)
    os.truncate(pool.path_for(keys[2]), 10)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LoadFailure):
        open_store(pool).pin(keys)
    assert len(os.listdir("/proc/self/fd")) == before
    assert pool.count_present(keys) == 2


@pytest.mark.parametrize("bad", [b"", b"\x00" * 31, b"\x00" * 33, "00" * 32, bytearray(32), None])
def test_only_32_byte_keys_form_paths(env, bad, native_impl):
    pool = env[0]
    with pytest.raises(ValueError):
        pool.path_for(bad)
    with pytest.raises(ValueError):
        pool.contains(bad)
    with pytest.raises(TypeError):  # the match's run of stats checks every key it names
        pool.count_present([bytes(32), bad])


def test_quarantine_falls_back_to_unlink(env):
    """With the quarantine directory gone and uncreatable, a bad file is removed rather than kept."""
    pool, engine, kv = env
    key = fh.key_of("no-quarantine-dir")
    path = _save(pool, engine, kv, key)
    q = os.path.join(pool.roots[0], LAYOUT_DIR, QUARANTINE_DIR)
    os.rmdir(q)
    with open(q, "w"):
        pass  # a file where the directory was: mkdir fails
    os.truncate(path, 10)
    with pytest.raises(LoadFailure):
        open_store(pool).pin([key])
    assert not os.path.lexists(path) and not pool.contains(key)


def _mode(p):
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.mark.parametrize("share_group", [False, True])
def test_permissions(tmp_path, share_group):
    """Files 0600 / dirs 0700 by default; 0640 / 2770 with share_group, whatever the umask."""
    old = os.umask(0o077 if share_group else 0o022)
    try:
        root = str(tmp_path / "pool")
        pool = fh.make_pool(root, share_group=share_group, geometry_note="test")
        engine = PosixEngine(io_threads=1)
        kv = fh.make_kv(1)
        key = fh.key_of("perm")
        assert open_store(pool, engine).save([key], [b""], [fh.fill(kv, 0, key)]).published == 1
        engine.close()
    finally:
        os.umask(old)
    want_file, want_dir = (0o640, 0o2770) if share_group else (0o600, 0o700)
    assert _mode(pool.path_for(key)) == want_file
    assert _mode(os.path.join(pool.fp_dirs[0], "fingerprint.json")) == want_file
    dirs = [os.path.dirname(pool.path_for(key)), pool.fp_dirs[0], os.path.join(root, LAYOUT_DIR),
            os.path.join(root, LAYOUT_DIR, QUARANTINE_DIR), os.path.join(root, LAYOUT_DIR, "owners")]
    for d in dirs:
        assert _mode(d) == want_dir, f"{d}: {oct(_mode(d))}"
