"""Operator commands against a pool written the way the connector writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support import REPO
import torch

from gds_kv_connector.cli import main as cli
from gds_kv_connector.format.layout import slab_tmp_name
from gds_kv_connector.store.base import open_store
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.maintenance.owner_stats import StatsPublisher, read_owner_stats, write_owner_stats
from gds_kv_connector.maintenance.operations import (EXIT_OK, EXIT_PROBLEMS, UsageError, format_gc, format_stats,
                                           gc, pool_roots, stats)
from gds_kv_connector.maintenance.verify import format_verify, verify
from gds_kv_connector.store.pool import BlockPool
from gds_kv_connector.format.layout import TMP_PREFIX
from gds_kv_connector.format.records import HEADER_SIZE, ZERO_KEY, SlotRef, pack_refs
from gds_kv_connector.maintenance.pool_scan import quarantine_dir, scan_pool
from gds_kv_connector.maintenance.recency import RecencyLog

PAYLOAD = 3 * 4096 + 100  # not page-aligned: the file carries padding
FILE = HEADER_SIZE + 4 * 4096


def key(fp_tag: int, i: int) -> bytes:
    return bytes([fp_tag]) + i.to_bytes(31, "big")


@pytest.fixture
def engine():
    eng = PosixEngine(io_threads=4)
    yield eng
    eng.close()


def fill(root, engine, fp: bytes, n: int, geometry: str = "test geometry") -> BlockPool:
    """Save a chain of ``n`` blocks with distinct contents through the connector's save path."""
    pool = BlockPool((str(root),), fp, PAYLOAD, 16, geometry_note=geometry)
    keys = [key(fp[0], i) for i in range(n)]
    views = [torch.arange(PAYLOAD, dtype=torch.int64).add(i * 7).to(torch.uint8) for i in range(n)]
    out = open_store(pool, engine).save(keys, [ZERO_KEY] + keys[:-1], views)
    assert out.published == n and not out.failed
    return pool


def test_stats_counts_blocks_leftovers_and_owner_counters(tmp_path, engine):
    root = str(tmp_path)
    fill(root, engine, b"\x01" * 32, 5, "model A tp1")
    pool_b = fill(root, engine, b"\x02" * 32, 3, "model B tp1")
    open(os.path.join(pool_b.dir_for(key(2, 0)), TMP_PREFIX + "x"), "wb").close()
    open(os.path.join(quarantine_dir(root), "bad.1.x"), "wb").write(b"abc")
    write_owner_stats(root, "node1-10", {"save_blocks": 4, "load_blocks": 1}, started_ns=1)
    write_owner_stats(root, "node2-20", {"save_blocks": 6}, started_ns=2)
    RecencyLog(root, "node1-10", flush_interval_s=0).close()
    result = stats(root)
    assert result["blocks"] == 8 and result["bytes"] == 8 * FILE
    fp_a = result["fingerprints"]["01" * 8]
    assert fp_a["blocks"] == 5 and fp_a["geometry"] == "model A tp1" and fp_a["tokens"] == 5 * 16
    assert fp_a["payload_len"] == PAYLOAD
    assert result["fingerprints"]["02" * 8]["blocks"] == 3
    assert result["quarantine"] == {"files": 1, "bytes": 3}
    assert result["tmp"]["files"] == 1
    assert result["counters_total"] == {"load_blocks": 1, "save_blocks": 10}
    assert set(result["owners"]) == {"node1-10.1", "node2-20.2"}
    assert [o["owner"] for o in result["owners"].values()] == ["node1-10", "node2-20"]
    json.dumps(result)
    text = format_stats(result)
    assert "8 blocks" in text and "model A tp1" in text and "node2-20" in text


def test_missing_pool_is_a_usage_error(tmp_path):
    for command in (lambda: stats(str(tmp_path)), lambda: verify(str(tmp_path), progress=False),
                    lambda: gc(str(tmp_path), 1, 0.5)):
        with pytest.raises(UsageError):
            command()


def test_verify_quarantines_flipped_payload_and_bad_header(tmp_path, engine):
    root = str(tmp_path)
    pool = fill(root, engine, b"\x03" * 32, 6)
    flipped, broken = pool.path_for(key(3, 2)), pool.path_for(key(3, 4))
    with open(flipped, "r+b") as fh:
        fh.seek(HEADER_SIZE + 1234)
        byte = fh.read(1)
        fh.seek(HEADER_SIZE + 1234)
        fh.write(bytes([byte[0] ^ 0x01]))
    with open(broken, "r+b") as fh:
        fh.seek(40)  # inside the key field: the header CRC no longer matches
        fh.write(b"\xff")
    result = verify(root, workers=3, progress=False)
    assert result["checked"] == 6 and result["ok"] == 4 and result["bad"] == 2
    assert result["reasons"] == {"checksum": 1, "header": 1}
    assert result["quarantined"] == 2 and result["exit_code"] == EXIT_PROBLEMS
    assert not os.path.exists(flipped) and not os.path.exists(broken)
    moved = {f["reason"]: f["quarantined_to"] for f in result["bad_files"]}
    assert all(os.path.exists(p) and p.startswith(quarantine_dir(root)) for p in moved.values())
    assert "header checksum mismatch" in format_verify(result)
    again = verify(root, workers=2, progress=False)
    assert again["checked"] == 4 and again["bad"] == 0 and again["exit_code"] == EXIT_OK


def test_verify_reports_progress_on_stderr(tmp_path, engine, capsys):
    fill(str(tmp_path), engine, b"\x04" * 32, 3)
    assert verify(str(tmp_path), workers=2, progress=True)["ok"] == 3
    assert "3/3" in capsys.readouterr().err


def test_gc_reaches_quota_or_says_why_not(tmp_path, engine):
    root = str(tmp_path)
    fill(root, engine, b"\x05" * 32, 10)
    held = gc(root, quota_bytes=4 * FILE, low_watermark=0.5, grace_s=3600)  # everything is brand new
    assert held["evicted_blocks"] == 0 and not held["within_budget"] and held["exit_code"] == EXIT_PROBLEMS
    assert "still over its budget" in format_gc(held)
    dry = gc(root, quota_bytes=4 * FILE, low_watermark=0.5, grace_s=0, dry_run=True)
    assert dry["evicted_blocks"] == 8 and len(scan_pool(root).blocks) == 10
    done = gc(root, quota_bytes=4 * FILE, low_watermark=0.5, grace_s=0)
    assert done["within_budget"] and done["exit_code"] == EXIT_OK
    assert done["usage_after"] == 2 * FILE and len(scan_pool(root).blocks) == 2
    assert "removed 8 blocks" in format_gc(done)
    json.dumps(done)


def test_gc_max_age_expires_everything_older(tmp_path, engine):
    root = str(tmp_path)
    fill(root, engine, b"\x06" * 32, 4)
    result = gc(root, quota_bytes=0, low_watermark=0.9, max_age_s=60, now=time.time() + 120)
    assert result["evicted_blocks"] == 4 and result["within_budget"] and scan_pool(root).blocks == []


def test_gc_rejects_bad_arguments(tmp_path, engine):
    fill(str(tmp_path), engine, b"\x07" * 32, 1)
    with pytest.raises(UsageError):
        gc(str(tmp_path), quota_bytes=10, low_watermark=1.5)


def test_owner_stats_are_replaced_atomically_and_garbage_is_skipped(tmp_path):
    root = str(tmp_path)
    counters = {"a": 1}
    pub = StatsPublisher([root], "me", lambda: counters, interval_s=3600)
    pub.publish()
    counters["a"] = 5
    pub.close()  # writes the final counters
    with open(os.path.join(root, "gdskv-v1", "owners", "junk.stats.json"), "w") as fh:
        fh.write("{not json")
    owners = read_owner_stats(root)
    mine = f"me.{pub.started_ns}"
    assert list(owners) == [mine] and owners[mine]["counters"] == {"a": 5} and owners[mine]["final"]
    assert [n for n in os.listdir(os.path.join(root, "gdskv-v1", "owners")) if ".tmp-" in n] == []


def fill_roots(roots, engine, firsts: list[int]) -> BlockPool:
    """A chain of blocks over several roots, the first byte of each key given (it picks the root)."""
    pool = BlockPool(tuple(map(str, roots)), b"\x09" * 32, PAYLOAD, 16, geometry_note="two roots")
    keys = [bytes([i]) + bytes(31) for i in firsts]
    n = len(keys)
    views = [torch.arange(PAYLOAD, dtype=torch.int64).add(i * 7).to(torch.uint8) for i in range(n)]
    assert open_store(pool, engine).save(keys, [ZERO_KEY] + keys[:-1], views).published == n
    return pool


def test_every_command_covers_every_root(tmp_path, engine, monkeypatch, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    pool = fill_roots((a, b), engine, list(range(8)))  # the roots take turns: 4 blocks in each
    corrupt = pool.path_for(bytes([1]) + bytes(31))
    assert corrupt.startswith(b)
    with open(corrupt, "r+b") as fh:
        fh.seek(HEADER_SIZE + 5)
        fh.write(b"\xff")
    monkeypatch.setenv("TLLM_GDS_KV_ROOT", f"{a}:{b}")
    monkeypatch.setenv("TLLM_GDS_KV_EVICT_GRACE_S", "300")

    def run(*argv: str) -> tuple[int, str]:
        rc = cli.main(list(argv))
        return rc, capsys.readouterr().out

    rc, out = run("stats", "--json")
    s = json.loads(out)
    assert rc == 0 and s["blocks"] == 8 and s["bytes"] == 8 * FILE and s["root"] == f"{a}:{b}"
    assert [(r["root"], r["blocks"]) for r in s["roots"]] == [(a, 4), (b, 4)]
    assert s["fingerprints"]["09" * 8]["blocks"] == 8
    rc, out = run("stats")
    assert f"pool {b}: 4 blocks" in out and f"\n  {b}: 0909090909090909" in out
    assert "total over 2 roots: 8 blocks" in out
    rc, out = run("verify", "--json")
    v = json.loads(out)
    assert rc == EXIT_PROBLEMS and v["checked"] == 8 and v["bad"] == 1 and v["exit_code"] == EXIT_PROBLEMS
    assert [(r["bad"], r["exit_code"]) for r in v["roots"]] == [(0, EXIT_OK), (1, EXIT_PROBLEMS)]
    assert not os.path.exists(corrupt)
    rc, out = run("verify")
    assert rc == EXIT_OK and f"pool {b}: 3 blocks checked" in out and "total over 2 roots: 7 blocks checked" in out


def test_stats_counts_temporary_slabs_per_root_and_in_total(tmp_path, engine):
    """A slab being created, or one whose creator died before naming it, holds a slab's bytes under a
    hidden temporary name: stats shows them apart from the slabs, per root and in the total."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fill_roots((a, b), engine, [0, 1])
    for root, sizes in ((a, {"node1-1-0.slab": 4096, slab_tmp_name("node1-1-1.slab"): 8192}),
                        (b, {slab_tmp_name("node1-2-0.slab"): 3 * 4096})):
        slab_dir = os.path.join(root, "gdskv-v1", "09" * 8, "slabs")
        os.makedirs(slab_dir)
        for name, size in sizes.items():
            with open(os.path.join(slab_dir, name), "wb") as fh:
                fh.truncate(size)
    result = stats(f"{a}:{b}")
    assert [r["slab_tmp"] for r in result["roots"]] == [{"files": 1, "bytes": 8192}, {"files": 1, "bytes": 3 * 4096}]
    assert result["slab_tmp"] == {"files": 2, "bytes": 5 * 4096}
    assert result["tmp"] == {"files": 0, "bytes": 0}
    assert [r["fingerprints"]["09" * 8]["slabs"] for r in result["roots"]] == [1, 0]
    assert json.loads(json.dumps(result))["slab_tmp"] == result["slab_tmp"]
    text = format_stats(result)
    assert f"  {a}: quarantine: 0 files (0 B); temporary: 0 files; access logs: 0 (0 B); temporary arena slabs: " \
           "1 files (8.0 KiB)" in text.splitlines()
    assert "temporary arena slabs: 1 files (12.0 KiB)" in text


def test_gc_takes_every_root_to_its_own_budget(tmp_path, engine, monkeypatch, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fill_roots((a, b), engine, [0, 2, 4, 6])  # a chain in root a
    fill_roots((a, b), engine, [1, 3, 5])  # and one in root b
    monkeypatch.setenv("TLLM_GDS_KV_EVICT_GRACE_S", "300")

    def run(*argv: str) -> tuple[int, str]:
        rc = cli.main(list(argv))
        return rc, capsys.readouterr().out

    # each root against its own quota: root a (4 blocks) is over 3 blocks' worth, root b (3) is not
    quota = str(3 * FILE + 1)
    rc, out = run("gc", "--root", f"{a}:{b}", "--quota", quota, "--json")  # all within the grace period
    g = json.loads(out)
    assert rc == EXIT_PROBLEMS and not g["within_budget"]
    assert [(r["within_budget"], r["exit_code"]) for r in g["roots"]] == [(False, EXIT_PROBLEMS), (True, EXIT_OK)]
    monkeypatch.setenv("TLLM_GDS_KV_EVICT_GRACE_S", "0")
    rc, out = run("gc", "--root", f"{a}:{b}", "--quota", quota)
    assert rc == EXIT_OK and f"pool {a}: removed 2 blocks" in out and f"pool {b}: removed 0 blocks" in out
    assert "total over 2 roots: removed 2 blocks" in out
    rc, out = run("gc", "--root", f"{a}:{b}", "--quota", quota, "--json")
    g = json.loads(out)
    assert rc == EXIT_OK and g["within_budget"] and g["evicted_blocks"] == 0
    assert [r["usage_after"] for r in g["roots"]] == [2 * FILE, 3 * FILE] and g["usage_after"] == 5 * FILE
    assert len(scan_pool(a).blocks) == 2 and len(scan_pool(b).blocks) == 3


def test_pool_roots_takes_each_root_once():
    assert pool_roots("/p/a::/p/b:/p/a") == ["/p/a", "/p/b"]
    with pytest.raises(UsageError):
        pool_roots(":")


def test_gc_dry_run_with_max_age_counts_each_block_once(tmp_path, engine):
    root = str(tmp_path)
    fill(root, engine, b"\x0a" * 32, 10)
    later = time.time() + 7200  # every block is two hours old: the expiry step takes them all
    args = dict(quota_bytes=4 * FILE, low_watermark=0.5, max_age_s=60, grace_s=0, now=later)
    dry = gc(root, dry_run=True, **args)
    assert dry["evicted_blocks"] == 10 and dry["evicted_bytes"] == 10 * FILE and dry["usage_after"] == 0
    assert "would remove 10 blocks" in format_gc(dry) and len(scan_pool(root).blocks) == 10
    real = gc(root, **args)
    assert (real["evicted_blocks"], real["usage_after"]) == (dry["evicted_blocks"], dry["usage_after"])


def test_gc_dry_run_quota_step_after_expiry_leaves_out_the_expired_blocks(tmp_path, engine):
    root = str(tmp_path)
    fill(root, engine, b"\x0b" * 32, 5)  # an old chain
    fill(root, engine, b"\x0c" * 32, 5)  # a chain used just now (its tail, so all of it)
    later = time.time() + 7200
    log = RecencyLog(root, "tester", flush_interval_s=0)
    log.touch([key(0x0c, 4)], int((later - 10) * 1e9))
    log.close()
    args = dict(quota_bytes=3 * FILE, low_watermark=0.5, max_age_s=60, grace_s=0, now=later)
    dry = gc(root, dry_run=True, **args)
    assert dry["evicted_blocks"] == 9 and dry["usage_after"] == FILE  # 5 expired, then 4 to reach 1.5 blocks
    assert [r["reason"] for r in dry["runs"]] == ["age", "quota"] and dry["runs"][1]["estimated"]
    assert "about 4 blocks" in format_gc(dry)
    real = gc(root, **args)
    assert (real["evicted_blocks"], real["usage_after"]) == (9, FILE)


def test_gc_dry_run_changes_nothing_on_disk(tmp_path, engine):
    root = str(tmp_path)
    fill(root, engine, b"\x0d" * 32, 6)

    def tree() -> dict[str, int]:
        return {os.path.join(d, n): os.lstat(os.path.join(d, n)).st_mtime_ns
                for d, dirs, files in os.walk(root) for n in dirs + files}
    before = tree()
    gc(root, quota_bytes=2 * FILE, low_watermark=0.5, max_age_s=60, grace_s=0, dry_run=True, now=time.time() + 30)
    assert tree() == before


def cli_run(root: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a child process, so that a hang fails the test instead of stopping the run."""
    repo = REPO
    return subprocess.run([sys.executable, "-m", "gds_kv_connector.cli.main", *args, "--root", root, "--json"],
                          cwd=repo, capture_output=True, text=True, timeout=30)


def test_verify_skips_a_slab_that_is_a_fifo(tmp_path):
    """open(2) of a FIFO waits for a writer for ever: a reference naming one must not hang verify."""
    root = str(tmp_path)
    pool = BlockPool((root,), b"\x0e" * 32, 4096, 16, geometry_note="t")
    k = key(0x0e, 1)
    os.makedirs(os.path.join(pool.fp_dirs[0], "slabs"))
    os.mkfifo(os.path.join(pool.fp_dirs[0], "slabs", "otherhost-1-abc.slab"))
    os.makedirs(pool.dir_for(k), exist_ok=True)
    with open(pool.path_for(k), "wb") as fh:
        fh.write(pack_refs(pool.fingerprint, pool.file_size, "otherhost-1-abc.slab",
                           [SlotRef(k, "otherhost-1-abc.slab", 0, 1)]))
    ver = cli_run(root, "verify", "--no-quarantine")
    v = json.loads(ver.stdout)
    assert ver.returncode == EXIT_PROBLEMS and v["bad"] == 1
    assert v["bad_files"][0]["detail"] == "slab otherhost-1-abc.slab is not a regular file"


def test_stats_skips_an_owner_stats_file_that_is_a_fifo(tmp_path):
    root = str(tmp_path)
    BlockPool((root,), b"\x0f" * 32, 4096, 16, geometry_note="t")
    os.mkfifo(os.path.join(root, "gdskv-v1", "owners", "x.stats.json"))
    st = cli_run(root, "stats")
    assert st.returncode == EXIT_OK and json.loads(st.stdout)["owners"] == {}


def test_cli_says_an_os_error_in_one_line(tmp_path, monkeypatch, capsys):
    import gds_kv_connector.maintenance.operations as ops

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/pool/gdskv-v1/owners")
    monkeypatch.setattr(ops, "stats", denied)
    assert cli.main(["stats", "--root", str(tmp_path)]) == EXIT_PROBLEMS
    assert capsys.readouterr().err == "gds-kv stats: Permission denied: /pool/gdskv-v1/owners\n"


def test_stats_reports_directories_it_cannot_read_instead_of_failing(tmp_path, engine, monkeypatch):
    """An owner's quarantine or owners directory made without TLLM_GDS_KV_SHARE_GROUP is unreadable
    to another user: stats stopped with PermissionError.  A hidden ``.x.slab`` is not a slab either
    (gc and the format skip names starting with a dot)."""
    root = str(tmp_path / "a")
    fill_roots((root,), engine, [0, 1])
    slab_dir = os.path.join(root, "gdskv-v1", "09" * 8, "slabs")
    os.makedirs(slab_dir)
    for name in ("node1-1-0.slab", ".x.slab"):
        with open(os.path.join(slab_dir, name), "wb") as fh:
            fh.truncate(4096)
    denied = {os.path.join(root, "gdskv-v1", d) for d in ("quarantine", "owners")}
    real = os.listdir

    def listdir(d="."):
        if os.fspath(d) in denied:
            raise PermissionError(13, "Permission denied", d)
        return real(d)
    monkeypatch.setattr(os, "listdir", listdir)
    result = stats(root)
    assert result["unreadable_entries"] == 2 and result["owners"] == {}
    assert result["fingerprints"]["09" * 8]["slabs"] == 1
    assert "cannot read (not counted): 2" in format_stats(result)
