"""The metrics path end to end, with a real Prometheus server (Debian's ``prometheus``).

A reference executor serves repeated prompts over a pool in tmp_path (an arena, a quota, one save
failing with ENOSPC), its owner publishing stats files every 0.25 s; ``gds-kv metrics --serve`` runs
as a child process; Prometheus scrapes it every second.  Then every query of the Grafana dashboard
(docs/grafana/gds-kv.json) runs against Prometheus's HTTP API and must return its series with
plausible values.  ``GDSKV_PLOT_DASHBOARD=<png>`` also draws the run's dashboard (docs/grafana/plot.py).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker
from gds_kv_connector.simulator import ExecutorConfig, ReferenceExecutor, fake_llm_args
from tests.support.connector_helpers import SHAPE, rand_tokens, serve
from tests.support.faults import FaultyFileOps

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docs" / "grafana" / "gds-kv.json"
PROMETHEUS = shutil.which("prometheus")
QUOTA = 2 << 20
WINDOW = "1m"  # $__rate_interval: the whole run, so a rate sees every increase

pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)"),
              pytest.mark.timeout(120)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def _query(api: str, expr: str) -> list[dict]:
    body = _get(f"{api}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _wait(what: str, ok, timeout: float = 20.0, every: float = 0.25):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            got = ok()
        except OSError:
            got = None
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def prometheus(tmp_path):
    """A Prometheus server of its own (config and data in tmp_path) scraping the exporter's port
    every second; yields (API URL, the exporter port to scrape)."""
    exporter_port, port = _free_port(), _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      "  - job_name: gdskv\n    scrape_timeout: 1s\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{exporter_port}']\n")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    api = f"http://127.0.0.1:{port}"
    try:
        _wait("prometheus to be ready", lambda: urllib.request.urlopen(f"{api}/-/ready", timeout=2).status == 200)
        yield api, exporter_port
    finally:
        _stop(proc)


@pytest.fixture
def owner(tmp_path, monkeypatch):
    """An owner (reference executor) over a pool in tmp_path with an arena and a quota, publishing its
    stats every 0.25 s; its pages' writes go through fault injection."""
    for k in list(os.environ):
        if k.startswith("TLLM_GDS_KV_"):
            monkeypatch.delenv(k)
    root = tmp_path / "pool"
    for k, v in {"ROOT": str(root), "STATS_INTERVAL_S": "0.25", "QUOTA_BYTES": str(QUOTA),
                 "ARENA_BYTES": "4MiB", "ARENA_SLAB_BYTES": "1MiB"}.items():
        monkeypatch.setenv(f"TLLM_GDS_KV_{k}", v)
    ops = FaultyFileOps()
    llm_args = fake_llm_args(SHAPE.tokens_per_block)
    ex = ReferenceExecutor(GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args, fileops=ops),
                           ExecutorConfig(shape=SHAPE, num_blocks=256))
    ex.worker.pool.arena.wait_ready(30)
    yield ex, ops, root
    ex.worker.shutdown()


@pytest.fixture
def exporter(owner, prometheus, tmp_path):
    """``gds-kv metrics --serve`` as a child process on the port Prometheus scrapes."""
    _, _, root = owner
    _, port = prometheus
    proc = subprocess.Popen([sys.executable, "-m", "gds_kv_connector.cli", "metrics", "--serve", "--address",
                             "127.0.0.1", "--port", str(port), "--root", str(root)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=tmp_path)
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 30)
        line = proc.stderr.readline().decode() if ready else ""
        assert f"127.0.0.1:{port}/metrics" in line, line or "the exporter printed nothing in 30 s"
        yield proc
    finally:
        _stop(proc)


def _run_workload(ex: ReferenceExecutor, ops: FaultyFileOps) -> None:
    """Cold prompts (misses, saves) each followed by the same prompt again (hits, loads), spread over
    several scrapes, one block write failing with ENOSPC."""
    for i in range(6):
        prompt = rand_tokens(400, 100 + i)
        if i == 2:
            ops.add("pwrite", "enospc", count=1)
        serve(ex, [prompt], first_id=100 * i)
        time.sleep(0.5)
        serve(ex, [prompt], first_id=100 * i + 50)
        time.sleep(0.5)


def _values(result: list[dict]) -> dict[str, float]:
    return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in result}


# Per panel, what every series of each target (by its legend) must satisfy; every value must be
# finite and not negative in any case.
POSITIVE = {"Hit rate (prompt blocks found / looked up)", "Tokens/s loaded and saved", "Bytes/s loaded and saved",
            "Load latency p50 / p99", "Save latency p50 / p99", "Forward wait for synchronous loads (s/s)"}


def _check_panel(title: str, by_legend: dict[str, dict[str, float]]) -> None:
    for legend, series in by_legend.items():
        assert series, f"{title}: {legend}: no series"
        for labels, v in series.items():
            assert math.isfinite(v) and v >= 0, (title, legend, labels, v)
            if title in POSITIVE:
                assert v > 0, (title, legend, labels, v)
    if title.startswith("Hit rate"):
        assert all(v <= 1 for s in by_legend.values() for v in s.values())
    if "latency" in title:
        (p50,), (p99,) = by_legend["p50"].values(), by_legend["p99"].values()
        assert p50 <= p99 < 60, (title, p50, p99)
    if title.startswith("Saves dropped"):
        assert by_legend["save failed: {{cause}}"][json.dumps({"cause": "ENOSPC"})] > 0
    if title == "Pool usage vs quota":
        (usage,), (quota,) = by_legend["usage"].values(), by_legend["quota"].values()
        assert 0 < usage <= quota == QUOTA
    if title == "Filesystem holding the pool":
        (used,), (size,) = by_legend["used {{root}}"].values(), by_legend["size {{root}}"].values()
        assert 0 < used <= size
    if title == "Arena slots":
        (owned,), (used,) = by_legend["owned"].values(), by_legend["used"].values()
        assert 0 < used <= owned


def test_every_dashboard_query_answers_from_a_real_prometheus(owner, prometheus, exporter, tmp_path):
    ex, ops, _ = owner
    api, _ = prometheus
    start = time.time()
    _wait("the owner's first scraped sample", lambda: _query(api, "gdskv_owner_match_queries_total"))
    _run_workload(ex, ops)
    _wait("the pool usage an eviction run measured", lambda: _query(api, "gdskv_pool_usage_bytes"))
    time.sleep(2.5)  # the last counters published (0.25 s) and scraped (1 s)
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len(panels) >= 11
    for panel in panels:
        by_legend = {t["legendFormat"]: _values(_query(api, t["expr"].replace("$__rate_interval", WINDOW)))
                     for t in panel["targets"]}
        _check_panel(panel["title"], by_legend)
    out = os.environ.get("GDSKV_PLOT_DASHBOARD")
    if out:
        spec = importlib.util.spec_from_file_location("plot", REPO / "docs" / "grafana" / "plot.py")
        plot = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plot)
        plot.plot(api, str(DASHBOARD), out, start, time.time(), step=1.0, rate_interval="10s")
