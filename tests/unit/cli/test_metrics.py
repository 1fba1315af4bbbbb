"""``gds-kv metrics``: owners' stats files (counters, gauges, latency histograms) as Prometheus metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gds_kv_connector.cli.main import main
from gds_kv_connector.maintenance.owner_stats import write_owner_stats
from gds_kv_connector.maintenance.pool_scan import owners_dir
from gds_kv_connector.maintenance.prometheus import counter_family, exposition
from gds_kv_connector.util.counters import LATENCY_BOUNDS_US, Stats, encode_histogram, split_histograms


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _pool(tmp_path) -> str:
    root = str(tmp_path / "pool")
    os.makedirs(owners_dir(root))
    return root


def test_stats_keeps_latency_histograms_that_travel_as_counters():
    st = Stats()
    for us in (50, 100, 101, 2_000_000, 10**9):  # at a bound counts in its bucket; past the last in +Inf only
        st.observe_us("load_latency_us", us)
    counters = st.histogram_counters()
    assert counters["load_latency_us_le_100"] == 2 and counters["load_latency_us_le_250"] == 3
    assert counters["load_latency_us_le_60000000"] == 4 and counters["load_latency_us_count"] == 5
    assert counters["load_latency_us_sum"] == 50 + 100 + 101 + 2_000_000 + 10**9
    assert st.snapshot() == {}  # the plain counters are what they were
    rest, hists = split_histograms({**counters, "bytes_loaded": 7})
    assert rest == {"bytes_loaded": 7}
    h = hists["load_latency_us"]
    assert h.bounds == LATENCY_BOUNDS_US and h.count == 5 and h.cumulative[0] == 2


def test_a_histogram_that_does_not_add_up_is_dropped_whole():
    counters = encode_histogram("save_latency_us", [1, 2] + [0] * len(LATENCY_BOUNDS_US), 30)
    counters["save_latency_us_le_250"] = 0  # falls: not cumulative
    rest, hists = split_histograms(counters)
    assert hists == {} and rest == {}
    rest, hists = split_histograms({"x_latency_us_le_100": 1})  # no count or sum
    assert hists == {} and rest == {}


def test_gauge_sources_are_read_at_each_snapshot():
    st, depth = Stats(), [3]
    st.add_gauges(lambda: {"transfer_queued_load_batches": depth[0]})
    assert st.gauges() == {"transfer_queued_load_batches": 3}
    depth[0] = 0
    assert st.gauges() == {"transfer_queued_load_batches": 0}


@pytest.mark.parametrize("name, family", [
    ("bytes_loaded", ("bytes_loaded", {}, 1.0)),
    ("sync_load_wait_us", ("sync_load_wait_seconds", {}, 1e6)),
    ("evict_ms", ("evict_seconds", {}, 1e3)),
    ("save_blocks_dropped_backlog", ("save_blocks_dropped", {"cause": "backlog"}, 1.0)),
    ("save_failed_ENOSPC", ("save_failed", {"cause": "ENOSPC"}, 1.0)),
    ("load_blocks_not_admitted", ("load_blocks_dropped", {"cause": "not_admitted"}, 1.0)),
    ("Not-A-Name", None),
])
def test_counter_names_become_prometheus_families(name, family):
    assert counter_family(name) == family


def test_owners_and_pool_totals_from_the_stats_files(tmp_path):
    """Per owner: live processes only, the newest start of an owner id; the pool: every process's
    counters and histograms (exited and retired ones too), live gauges summed, usage the largest."""
    root = _pool(tmp_path)
    hist = encode_histogram("load_latency_us", [1, 0, 2] + [0] * (len(LATENCY_BOUNDS_US) - 2), 700)
    write_owner_stats(root, "a-1", {"bytes_loaded": 10, **hist}, gauges={"arena_used_slots": 4}, started_ns=1,
                      interval_s=60)
    write_owner_stats(root, "a-1", {"bytes_loaded": 20, "match_blocks_hit": 3, "save_failed_EIO": 2},
                      gauges={"arena_used_slots": 5, "pool_usage_bytes": 100, "pool_quota_bytes": 1000},
                      started_ns=2, interval_s=60)
    write_owner_stats(root, "b-2", {"bytes_loaded": 40, "sync_load_wait_us": 1_500_000},
                      gauges={"arena_used_slots": 9, "pool_usage_bytes": 300}, started_ns=3, interval_s=60,
                      final=True)
    with open(os.path.join(owners_dir(root), "retired-owners.json"), "w") as fh:
        json.dump({"version": 1, "retired": 2, "counters": {"bytes_loaded": 1000}, "folded": {}}, fh)
    s = _samples(exposition([root]))
    owner = frozenset({("owner", "a-1"), ("host", _host_of(s))})
    assert s[("gdskv_owner_bytes_loaded_total", owner)] == 20  # the newest start of a-1
    assert s[("gdskv_owner_match_queries_total", owner)] == 0  # exported at 0 until it grows
    assert not any(dict(k[1]).get("owner") == "b-2" for k in s)  # exited: in the totals only
    assert s[("gdskv_bytes_loaded_total", frozenset())] == 10 + 20 + 40 + 1000
    assert s[("gdskv_sync_load_wait_seconds_total", frozenset())] == 1.5
    assert s[("gdskv_save_failed_total", frozenset({("cause", "EIO")}))] == 2
    assert s[("gdskv_save_failed_total", frozenset({("cause", "ENOSPC")}))] == 0
    assert s[("gdskv_arena_used_slots", frozenset())] == 4 + 5  # live processes' gauges
    assert s[("gdskv_pool_usage_bytes", frozenset())] == 100 and s[("gdskv_pool_quota_bytes", frozenset())] == 1000
    assert s[("gdskv_load_latency_seconds_bucket", frozenset({("le", "0.0001")}))] == 1
    assert s[("gdskv_load_latency_seconds_bucket", frozenset({("le", "0.0005")}))] == 3
    assert s[("gdskv_load_latency_seconds_count", frozenset())] == 3
    assert s[("gdskv_load_latency_seconds_sum", frozenset())] == pytest.approx(0.0007)
    assert s[("gdskv_owner_load_latency_seconds_count", owner)] == 0  # the newest start observed none
    assert s[("gdskv_owners_live", frozenset())] == 1 and s[("gdskv_owners_published", frozenset())] == 3
    assert s[("gdskv_owners_retired", frozenset())] == 2
    assert s[("gdskv_filesystem_size_bytes", frozenset({("root", root)}))] > 0


def _host_of(samples: dict) -> str:
    return next(dict(k[1])["host"] for k in samples if k[0] == "gdskv_owner_bytes_loaded_total")


def test_names_that_would_repeat_a_series_are_left_out(tmp_path):
    """Prometheus refuses a whole scrape with a series twice: a file's ``x_us`` and ``x_seconds``, or a
    gauge named like the exporter's own, must not make one."""
    root = _pool(tmp_path)
    write_owner_stats(root, "a-1", {"wait_us": 2_000_000, "wait_seconds": 7, "Bad Name": 1},
                      gauges={"owners_live": 99}, started_ns=1, interval_s=60)
    text = exposition([root])
    assert [ln.split()[0] for ln in text.splitlines()].count("gdskv_wait_seconds_total") == 1
    assert [ln for ln in text.splitlines() if ln.startswith("gdskv_owners_live ")] == ["gdskv_owners_live 1.0"]
    assert "Bad" not in text


def test_metrics_prints_once_with_the_settings_root(tmp_path, monkeypatch, capsys):
    root = _pool(tmp_path)
    write_owner_stats(root, "a-1", {"bytes_saved": 5}, started_ns=1, interval_s=60)
    monkeypatch.setenv("TLLM_GDS_KV_ROOT", root)
    assert main(["metrics"]) == 0
    assert _samples(capsys.readouterr().out)[("gdskv_bytes_saved_total", frozenset())] == 5
    assert main(["metrics", "--root", str(tmp_path / "absent")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def _exporter(root: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gds_kv_connector.cli", "metrics", "--serve", "--address",
                             "127.0.0.1", "--port", str(port), "--root", root], stderr=subprocess.PIPE, text=True)


def test_the_exporter_serves_scrapes_and_stops_on_sigterm(tmp_path):
    root = _pool(tmp_path)
    write_owner_stats(root, "a-1", {"bytes_saved": 5}, started_ns=1, interval_s=60)
    proc = _exporter(root, 0)
    try:
        line = proc.stderr.readline()
        port = int(re.search(r":(\d+)/metrics", line)[1])
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert _samples(body)[("gdskv_owners_live", frozenset())] == 1
        write_owner_stats(root, "a-1", {"bytes_saved": 9}, started_ns=1, interval_s=60)  # each scrape reads afresh
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert _samples(body)[("gdskv_bytes_saved_total", frozenset())] == 9
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_taken_port_is_one_line(tmp_path):
    root = _pool(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _exporter(root, port)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert err.count("\n") == 1 and f"127.0.0.1:{port}" in err and "in use" in err, err


def test_the_worker_publishes_histograms_tokens_queue_depth_and_pool_usage(pool_env, monkeypatch):
    from tests.support.connector_helpers import make_executor, rand_tokens, serve

    monkeypatch.setenv("TLLM_GDS_KV_QUOTA_BYTES", "64MiB")
    ex = make_executor()
    try:
        prompt = rand_tokens(200, 3)
        serve(ex, [prompt])
        serve(ex, [prompt], first_id=10)
        assert ex.worker.capacity.check_now(30)
        time.sleep(0.1)  # a save's latency is observed just after its future completes
        snap = ex.worker._snapshot()
    finally:
        ex.worker.shutdown()
    pool = ex.worker.pool
    assert snap["load_latency_us_count"] >= 1 and snap["save_latency_us_count"] >= 1
    assert snap["tokens_loaded"] == snap["bytes_loaded"] // pool.payload_len * pool.tokens_per_block > 0
    assert snap["tokens_saved"] == snap["blocks_saved"] * pool.tokens_per_block > 0
    gauges = snap.gauges
    assert {"transfer_queued_load_batches", "transfer_queued_save_batches", "transfer_inflight_batches",
            "transfer_save_backlog_bytes"} <= set(gauges)
    assert gauges["pool_quota_bytes"] == 64 << 20 and 0 < gauges["pool_usage_bytes"] <= 64 << 20
