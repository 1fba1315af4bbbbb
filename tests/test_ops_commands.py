"""Operator commands against a pool written the way the connector writes it."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from gds_kv_connector.block_io import save_blocks
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.metrics import StatsPublisher, read_owner_stats, render_prometheus, write_owner_stats
from gds_kv_connector.ops_commands import (EXIT_OK, EXIT_PROBLEMS, UsageError, format_gc, format_stats,
                                           format_verify, gc, stats, verify)
from gds_kv_connector.pool import TMP_PREFIX, BlockPool
from gds_kv_connector.pool_format import HEADER_SIZE, ZERO_KEY
from gds_kv_connector.pool_scan import quarantine_dir, scan_pool
from gds_kv_connector.recency import RecencyLog

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
    out = save_blocks(pool, engine, keys, [ZERO_KEY] + keys[:-1], views)
    assert out.published == n and not out.failed
    return pool


def test_stats_counts_blocks_leftovers_and_owner_counters(tmp_path, engine):
    root = str(tmp_path)
    fill(root, engine, b"\x01" * 32, 5, "model A tp1")
    pool_b = fill(root, engine, b"\x02" * 32, 3, "model B tp1")
    open(os.path.join(pool_b.dir_for(key(2, 0)), TMP_PREFIX + "x"), "wb").close()
    open(os.path.join(quarantine_dir(root), "bad.1.x"), "wb").write(b"abc")
    write_owner_stats(root, "node1-10", {"save_blocks": 4, "load_blocks": 1})
    write_owner_stats(root, "node2-20", {"save_blocks": 6})
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
    assert set(result["owners"]) == {"node1-10", "node2-20"}
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


def test_prometheus_text_format():
    text = render_prometheus({"save_blocks": 3, "load-bytes": 10}, {"owner": 'n"1\\x', "root": "/p"})
    assert text.splitlines() == [
        "# TYPE gdskv_load_bytes_total counter",
        'gdskv_load_bytes_total{owner="n\\"1\\\\x",root="/p"} 10',
        "# TYPE gdskv_save_blocks_total counter",
        'gdskv_save_blocks_total{owner="n\\"1\\\\x",root="/p"} 3',
    ]
    assert render_prometheus({}, None) == ""


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
    assert list(owners) == ["me"] and owners["me"]["counters"] == {"a": 5}
    assert [n for n in os.listdir(os.path.join(root, "gdskv-v1", "owners")) if ".tmp-" in n] == []
