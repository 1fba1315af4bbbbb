"""``gds-kv settings --check`` and ``gds-kv doctor`` test each root: a directory this process can
create files in (or create), O_DIRECT or not, with room for the slot arena."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from gds_kv_connector.cli.main import main


@pytest.fixture
def root_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("TLLM_GDS_KV_"):
            monkeypatch.delenv(k)
    return lambda root: monkeypatch.setenv("TLLM_GDS_KV_ROOT", str(root))


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs mount (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {proc.stderr.strip() or proc.returncode}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.fixture
def immutable_dir(tmp_path):
    """A directory with the immutable attribute (chattr +i; skipped where that is not possible)."""
    d = tmp_path / "immutable"
    d.mkdir()
    chattr = shutil.which("chattr")
    proc = subprocess.run([chattr, "+i", str(d)], capture_output=True, text=True) if chattr else None
    if proc is None or proc.returncode:
        pytest.skip(f"cannot make a directory immutable here: {proc.stderr.strip() if proc else 'no chattr'}")
    yield d
    subprocess.run([chattr, "-i", str(d)], check=True)


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _refused(capsys, root, says: str) -> None:
    """settings --check fails in one line; doctor reports the root unusable and exits 1."""
    code, _, err = _check(capsys, "settings", "--check")
    assert code == 2 and err.count("\n") == 1 and says in err and f"pool root {root} " in err, err
    assert "TLLM_GDS_KV_ROOT must name directories this process can create files in" in err
    code, out, _ = _check(capsys, "doctor")
    assert code == 1 and says in out, out
    assert "does not exist" not in out or "cannot be created" in out


def test_a_regular_file_is_not_a_root(capsys, root_env, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    root_env(f)
    _refused(capsys, f, "is a regular file, not a directory")


def test_a_read_only_mount_is_not_a_root(capsys, root_env, read_only_dir):
    root_env(read_only_dir)
    _refused(capsys, read_only_dir, "does not let this process create files (Read-only file system)")
    root_env(read_only_dir / "pool")  # missing, and not creatable there
    _refused(capsys, read_only_dir / "pool", f"cannot be created in {read_only_dir} (Read-only file system)")


def test_an_immutable_directory_is_not_a_root(capsys, root_env, immutable_dir):
    root_env(immutable_dir)
    _refused(capsys, immutable_dir, "does not let this process create files (Operation not permitted)")


def test_a_usable_root_says_where_it_is_and_whether_o_direct_works(capsys, root_env, tmp_path):
    root_env(tmp_path)
    code, out, _ = _check(capsys, "settings", "--check")
    assert code == 0 and out.startswith(f"settings OK: pool root(s) {tmp_path} (") and "O_DIRECT " in out
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".gdskv-")]  # its test files are gone
    root_env(tmp_path / "new" / "pool")
    code, out, _ = _check(capsys, "settings", "--check")
    assert code == 0 and f"does not exist; the connector creates it in {tmp_path}" in out
    code, out, _ = _check(capsys, "doctor")
    assert code == 0 and f"root {tmp_path / 'new' / 'pool'}: does not exist; the connector creates it" in out


def test_an_arena_the_root_cannot_hold_is_refused(capsys, root_env, tmp_path, monkeypatch):
    root_env(tmp_path)
    monkeypatch.setenv("TLLM_GDS_KV_ARENA_BYTES", "1EiB")
    code, _, err = _check(capsys, "settings", "--check")
    assert code == 2 and err.count("\n") == 1 and "TLLM_GDS_KV_ARENA_BYTES=1EiB does not fit" in err
    code, out, _ = _check(capsys, "doctor")
    assert code == 1 and "unusable: the slot arena (TLLM_GDS_KV_ARENA_BYTES, " in out and "does not fit" in out
