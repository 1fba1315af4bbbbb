"""``gds-kv doctor`` on any machine: complete, fast, JSON-safe, and never raising."""

from __future__ import annotations

import json
import os
import time

import pytest

from gds_kv_connector.cli.doctor import doctor_report, format_doctor

TOP_KEYS = {"python", "torch", "cupy", "kvikio", "env", "nvidia_fs", "run_udev_readable", "cufile_json",
            "roots", "probe", "warnings", "hints", "verdict"}
VERDICTS = ("posix", "none", "unknown", "staged-direct", "kvikio-posix", "cufile-compat", "gds")


def test_report_on_a_tmp_root(tmp_path):
    started = time.monotonic()
    report = doctor_report(str(tmp_path))
    assert time.monotonic() - started < 60
    assert TOP_KEYS <= report.keys()
    json.dumps(report)
    (root,) = report["roots"]
    assert root["exists"] and root["path"] == str(tmp_path)
    assert root["fs_type"] and root["fs_type"] != "unknown"
    real = os.path.realpath(tmp_path)
    assert real == root["mount_point"] or real.startswith(root["mount_point"].rstrip("/") + "/")
    assert isinstance(root["o_direct_write"], bool)
    assert root["o_direct_write"] or root["o_direct_error"]
    assert root["total_bytes"] >= root["free_bytes"] >= 0
    assert os.listdir(tmp_path) == [], "the O_DIRECT check must remove its file"
    assert report["verdict"].split(" ", 1)[0] in VERDICTS
    text = format_doctor(report)
    assert f"root {tmp_path}" in text and text.splitlines()[-1].startswith("verdict: ")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_tmpfs_root_is_recognised():
    (root,) = doctor_report("/dev/shm", probe=False)["roots"]
    assert root["fs_type"] == "tmpfs"


def test_missing_and_absent_roots_do_not_raise(tmp_path):
    missing = str(tmp_path / "nope")
    report = doctor_report(f"{tmp_path}:{missing}")
    assert [r["exists"] for r in report["roots"]] == [True, False]
    assert report["roots"][1]["problem"] is None and report["exit_code"] == 0  # the connector creates it
    assert f"{missing}: does not exist; the connector creates it in {tmp_path}" in format_doctor(report)
    assert doctor_report(None)["roots"] == []
    format_doctor(doctor_report(None))


def test_cpu_only_machine_verdict_is_posix(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    report = doctor_report(str(tmp_path))
    assert report["verdict"].startswith("posix")
    assert report["probe"]["ran"] is False


def test_cufile_json_follows_the_environment(tmp_path, monkeypatch):
    cfg = tmp_path / "cufile.json"
    cfg.write_text("{}")
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(cfg))
    report = doctor_report(None, probe=False)
    assert report["cufile_json"] == {"path": str(cfg), "exists": True, "source": "CUFILE_ENV_PATH_JSON"}
    assert report["env"]["CUFILE_ENV_PATH_JSON"] == str(cfg)


@pytest.mark.parametrize("compat_io,prefix", [("staged", "staged-direct"), ("kvikio", "kvikio-posix")])
def test_verdict_names_who_moves_files_without_gds(compat_io, prefix):
    """Where KvikIO would take its POSIX path, the verdict names the path TLLM_GDS_KV_COMPAT_IO picks."""
    from gds_kv_connector.cli.doctor import _verdict

    base = {"torch": {"cuda_available": True}, "run_udev_readable": False, "roots": [], "compat_io": compat_io,
            "kvikio": {"importable": True, "compat_mode_preferred": True, "compat_mode": "AUTO"},
            "probe": {"ran": False, "ok": None, "reason": ""}}
    assert _verdict(base).startswith(f"{prefix} (KVIKIO_COMPAT_MODE=AUTO chose KvikIO's POSIX path: /run/udev")
    on = {**base, "kvikio": {**base["kvikio"], "compat_mode": "ON"}}
    assert _verdict(on) == f"{prefix} (KVIKIO_COMPAT_MODE=ON)"
    fallback = {**base, "kvikio": {"importable": True, "compat_mode_preferred": False},
                "probe": {"ran": True, "ok": False, "reason": "file descriptor is not registered"}}
    assert _verdict(fallback) == f"{prefix} (fallback: file descriptor is not registered)"


def test_compat_io_is_read_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TLLM_GDS_KV_COMPAT_IO", "kvikio")
    assert doctor_report(str(tmp_path), probe=False)["compat_io"] == "kvikio"
    monkeypatch.setenv("TLLM_GDS_KV_COMPAT_IO", "bogus")
    assert doctor_report(str(tmp_path), probe=False)["compat_io"].startswith("invalid (")


def test_arena_kind_and_an_arena_larger_than_the_free_space_are_reported(monkeypatch, tmp_path):
    from gds_kv_connector.cli.doctor import format_doctor

    report = doctor_report(str(tmp_path), probe=False)
    assert report["arena_bytes"] == 0
    assert len(report["hints"]) == 1 and "without the slot arena" in report["hints"][0]
    assert "hint: " in format_doctor(report)
    monkeypatch.setenv("TLLM_GDS_KV_ARENA_BYTES", "1MiB")
    report = doctor_report(str(tmp_path), probe=False)
    assert report["arena_bytes"] == 1 << 20 and not any("slot arena" in w for w in report["warnings"])
    assert report["hints"] == []
    kind = "mapped slabs" if report["roots"][0]["fs_type"] in ("tmpfs", "ramfs", "hugetlbfs") else "O_DIRECT"
    assert "slot arena: " in format_doctor(report) and kind in format_doctor(report)
    monkeypatch.setenv("TLLM_GDS_KV_ARENA_BYTES", str(report["roots"][0]["free_bytes"] + (1 << 40)))
    report = doctor_report(str(tmp_path), probe=False)
    assert "does not fit" in report["roots"][0]["problem"] and report["exit_code"] == 1
