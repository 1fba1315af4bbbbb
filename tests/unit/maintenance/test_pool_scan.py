"""Walking a pool that holds what a shared directory can hold: unreadable directories, FIFOs and
stray names must be counted or skipped by stats, verify and gc, never raised or waited on."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gds_kv_connector.store.base import open_store
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.maintenance.operations import format_gc, format_stats, gc, stats
from gds_kv_connector.maintenance.verify import format_verify, verify
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.records import ZERO_KEY
from gds_kv_connector.maintenance.pool_scan import (NotRegularFile, quarantine_dir, quarantined_at_ns, read_geometry,
                                        read_published, scan_pool)

FP = b"\x22" * 32
PAYLOAD = 4096
HANG_S = 10.0  # far above any of these calls; a FIFO open without O_NONBLOCK never returns


def key(i: int) -> bytes:
    """Keys in distinct key directories (first byte 0x10, 0x30, 0x50, ...)."""
    return bytes([0x10 + 0x20 * i]) + bytes(31)


@pytest.fixture
def pool(tmp_path) -> BlockPool:
    """Four complete blocks, one per key directory, saved through the connector's save path."""
    p = BlockPool((str(tmp_path),), FP, PAYLOAD, 16, geometry_note="test geometry")
    eng = PosixEngine(io_threads=2)
    try:
        keys = [key(i) for i in range(4)]
        views = [torch.full((PAYLOAD,), i + 1, dtype=torch.uint8) for i in range(4)]
        assert open_store(p, eng).save(keys, [ZERO_KEY] * 4, views).published == 4
    finally:
        eng.close()
    return p


def _failing_scandir(monkeypatch, bad_dir: str, exc: OSError) -> None:
    """os.scandir raising ``exc`` for ``bad_dir``: what a directory made 0700 by another owner of a
    group-shared pool does to everyone else (root would read it, so the error is injected)."""
    real = os.scandir

    def scandir(path=".", *a, **kw):
        if os.fspath(path) == bad_dir:
            raise exc
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", scandir)


def test_unreadable_key_directory_is_counted_and_the_rest_scanned(pool, monkeypatch):
    _failing_scandir(monkeypatch, pool.dir_for(key(1)), PermissionError(errno.EACCES, "Permission denied"))
    scan = scan_pool(pool.roots[0])
    assert sorted(b.key for b in scan.blocks) == [key(0), key(2), key(3)]
    assert scan.unreadable == 1


def test_unreadable_key_directory_does_not_abort_stats_verify_gc(pool, monkeypatch):
    """The operator commands run through: gds-kv stats/verify/gc died with a traceback."""
    root = pool.roots[0]
    _failing_scandir(monkeypatch, pool.dir_for(key(1)), PermissionError(errno.EACCES, "Permission denied"))
    st = stats(root)
    assert st["blocks"] == 3 and st["unreadable_entries"] == 1
    assert "cannot read (not counted): 1" in format_stats(st)
    result = verify(root, workers=2, progress=False)
    # ... and do not call a pool they could not read whole clean, nor within its budget
    assert (result["ok"], result["bad"], result["unreadable_entries"], result["exit_code"]) == (3, 0, 1, 1)
    assert "could not be read: their blocks were not checked" in format_verify(result)
    result = gc(root, 0, 0.5)
    assert result["runs"][0]["scanned_blocks"] == 3
    assert (result["within_budget"], result["unreadable_entries"], result["exit_code"]) == (False, 1, 1)
    assert "the budget is not known to be met" in format_gc(result)
    dry = gc(root, 0, 0.5, max_age_s=3600, dry_run=True)  # the quota step derived from the expiry's scan too
    assert (dry["within_budget"], dry["unreadable_entries"], dry["exit_code"]) == (False, 1, 1)


def test_unreadable_fingerprint_and_layout_directories_are_counted(pool, monkeypatch):
    real = os.listdir
    bad = {pool.fp_dirs[0]}

    def listdir(path="."):
        if os.fspath(path) in bad:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    scan = scan_pool(pool.roots[0])
    assert scan.blocks == [] and scan.unreadable == 1
    bad.add(os.path.dirname(pool.fp_dirs[0]))  # the layout directory itself
    scan = scan_pool(pool.roots[0])
    assert scan.blocks == [] and scan.unreadable == 1


class _Entry:
    """A directory entry whose lstat fails, as in a directory listable but not searchable (r-x)."""

    def __init__(self, real: os.DirEntry) -> None:
        self.name, self.path = real.name, real.path

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        raise PermissionError(errno.EACCES, "Permission denied", self.path)


class _Listing:
    """A scandir iterator that yields ``wrap(entry)`` and may fail after ``fail_after`` entries."""

    def __init__(self, path: str, wrap: Callable[[Any], Any], fail_after: int | None) -> None:
        self.entries = [wrap(e) for e in os.scandir(path)]  # the real one, taken before the patch
        self.fail_after = fail_after

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __iter__(self):
        for n, e in enumerate(self.entries):
            if n == self.fail_after:
                raise OSError(errno.EIO, "Input/output error")
            yield e


def test_entry_that_cannot_be_lstatted_is_counted(pool, monkeypatch):
    d = pool.dir_for(key(2))
    real = os.scandir
    listing = _Listing(d, _Entry, None)
    monkeypatch.setattr(os, "scandir", lambda p=".", *a, **kw: listing if os.fspath(p) == d else real(p, *a, **kw))
    scan = scan_pool(pool.roots[0])
    assert sorted(b.key for b in scan.blocks) == [key(0), key(1), key(3)]
    assert scan.unreadable == 1


def test_read_error_part_way_keeps_what_was_listed(pool, monkeypatch):
    d = pool.dir_for(key(3))
    extra = key(3)[:1] + b"\x01" * 31  # a second block in the same directory
    eng = PosixEngine(io_threads=1)
    try:
        assert open_store(pool, eng).save([extra], [ZERO_KEY], [torch.zeros(PAYLOAD, dtype=torch.uint8)]).published == 1
    finally:
        eng.close()
    real = os.scandir
    listing = _Listing(d, lambda e: e, 1)
    monkeypatch.setattr(os, "scandir", lambda p=".", *a, **kw: listing if os.fspath(p) == d else real(p, *a, **kw))
    scan = scan_pool(pool.roots[0])
    assert len(scan.blocks) == 4 and scan.unreadable == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a 0000 directory; the injected tests cover root")
def test_real_unreadable_key_directory_as_non_root(pool):
    d = pool.dir_for(key(1))
    os.chmod(d, 0)
    try:
        scan = scan_pool(pool.roots[0])
        assert len(scan.blocks) == 3 and scan.unreadable == 1
        assert stats(pool.roots[0])["blocks"] == 3
    finally:
        os.chmod(d, 0o700)


# -- quarantine names -----------------------------------------------------------------------------
@pytest.mark.parametrize("stamp", ["\u00b2", "\u0663\u0663", "9" * 200, ""])
def test_quarantine_name_without_a_plain_time_falls_back_to_ctime(tmp_path, stamp):
    """'²' passes str.isdigit but not int(), Arabic-Indic digits pass both; 200 digits would be a time
    so far ahead that the entry was never removed."""
    path = tmp_path / f"junk.{stamp}.x"
    path.write_bytes(b"")
    assert quarantined_at_ns(str(path)) == os.stat(path).st_ctime_ns


def test_quarantine_name_time_is_read(tmp_path):
    path = tmp_path / f"{'ab' * 32}.1700000000123456789.beef.bad_header"
    path.write_bytes(b"")
    assert quarantined_at_ns(str(path)) == 1700000000123456789


def test_stray_quarantine_names_do_not_abort_gc(pool):
    """gds-kv gc exited 2 ("usage error") on quarantine/junk.², and the online evictor died the same way."""
    qdir = quarantine_dir(pool.roots[0])
    for name in ("junk.\u00b2", "junk." + "9" * 200):
        open(os.path.join(qdir, name), "wb").close()
    result = gc(pool.roots[0], 0, 0.5)
    assert result["runs"][0]["quarantine_removed"] == 0  # just made: kept for QUARANTINE_KEEP_S
    later = gc(pool.roots[0], 0, 0.5, now=time.time() + 2 * 86_400)
    assert later["runs"][0]["quarantine_removed"] == 2


# -- FIFOs and links where files belong -----------------------------------------------------------
def _returns(fn: Callable[[], Any], fifo: str) -> Any:
    """``fn()``'s result; fails (instead of hanging) if it blocks in open(2) of ``fifo``."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(_capture(fn)), daemon=True)
    t.start()
    t.join(HANG_S)
    if t.is_alive():
        try:  # a writer end releases the reader blocked in open(2)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        t.join(HANG_S)
        pytest.fail(f"blocked opening the FIFO {fifo}")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _capture(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as exc:  # re-raised on the test's thread
        return exc


def test_fifo_fingerprint_json_is_not_waited_on(pool):
    root, fp = pool.roots[0], os.path.basename(pool.fp_dirs[0])
    fj = os.path.join(pool.fp_dirs[0], "fingerprint.json")
    assert read_geometry(root, fp)["geometry"] == "test geometry"
    os.unlink(fj)
    os.mkfifo(fj)
    assert _returns(lambda: read_geometry(root, fp), fj) is None
    assert _returns(lambda: stats(root), fj)["blocks"] == 4


def test_linked_fingerprint_json_is_not_followed(pool, tmp_path):
    fj = os.path.join(pool.fp_dirs[0], "fingerprint.json")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"geometry": "not this pool"}')
    os.unlink(fj)
    os.symlink(elsewhere, fj)
    assert read_geometry(pool.roots[0], os.path.basename(pool.fp_dirs[0])) is None


def test_block_swapped_for_a_fifo_after_the_scan_is_not_waited_on(pool):
    """gc reads headers of scanned blocks; one replaced by a FIFO meanwhile is an unreadable header
    (an OSError, as eviction counts it), not a hang."""
    block = next(b for b in scan_pool(pool.roots[0]).blocks if b.key == key(0))
    assert read_published(block)[1].key == key(0)
    os.unlink(block.path)
    os.mkfifo(block.path)
    with pytest.raises(NotRegularFile):
        _returns(lambda: read_published(block), block.path)


def test_gc_keeps_free_slabs_when_a_directory_of_references_was_not_read(pool, monkeypatch):
    """A slab is removed only when no reference names it; a reference in a key directory the scan
    could not read may name it, so gc keeps every free slab until the whole pool is readable."""
    from gds_kv_connector.format.layout import SLABS_DIR, slab_host_is_this
    from gds_kv_connector.util.host import host_tag
    from gds_kv_connector.format.records import SlotRef, pack_refs
    from gds_kv_connector.maintenance.slab_gc import remove_orphan_slabs

    slab = f"{host_tag()}-1-abcd.slab"
    assert slab_host_is_this(slab)
    os.makedirs(os.path.join(pool.fp_dirs[0], SLABS_DIR))
    with open(os.path.join(pool.fp_dirs[0], SLABS_DIR, slab), "wb") as fh:
        fh.truncate(pool.file_size)
    ref_key = key(1)[:1] + b"\x02" * 31  # a reference file in key(1)'s directory names the slab
    with open(pool.path_for(ref_key), "wb") as fh:
        fh.write(pack_refs(pool.fingerprint, pool.file_size, slab, [SlotRef(ref_key, slab, 0, 1)]))
    later = time.time() + 120
    _failing_scandir(monkeypatch, pool.dir_for(key(1)), PermissionError(errno.EACCES, "Permission denied"))
    r = remove_orphan_slabs(pool.roots[0], now=later)
    assert (len(r.removed), r.kept_referenced) == (0, 1)
    monkeypatch.undo()
    r = remove_orphan_slabs(pool.roots[0], now=later)  # readable: the reference is seen and keeps it
    assert (len(r.removed), r.kept_referenced) == (0, 1)
    os.unlink(pool.path_for(ref_key))
    assert len(remove_orphan_slabs(pool.roots[0], now=later).removed) == 1
