"""Who may write the pool, and what a reader does with everything else (docs/format.md, "Trust").

Attacks from the outside on real files: a block this owner can stat but not open (EACCES, as an
unprivileged user: root passes every permission check), a persistent EIO on a promised block, a key
directory or a block file of another uid or writable by every user, junk (directory, FIFO, symbolic
link, wrong-size file) at a block's name in front of a save, and a header whose payload length would
make ``gds-kv verify`` allocate a gigabyte.  Each must end as a miss or a clear, attributed failure
that moves the file out of the key's name, so no owner, restarted or not, meets it again.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import traceback

import pytest

from tests.support import REPO

pytest.register_assert_rewrite("tests.support.fault_helpers")
from tests.support import fault_helpers as fh  # noqa: E402
from gds_kv_connector.store.arena import SlotArena  # noqa: E402
from gds_kv_connector.store.base import LoadFailure, open_store  # noqa: E402
from gds_kv_connector.engines.posix import PosixEngine  # noqa: E402
from tests.support.faults import FaultyFileOps  # noqa: E402
from gds_kv_connector.maintenance.operations import EXIT_OK, EXIT_PROBLEMS  # noqa: E402
from gds_kv_connector.maintenance.verify import verify  # noqa: E402
from gds_kv_connector.store.pool import BlockPool, PoolError  # noqa: E402
from gds_kv_connector.format.records import HEADER_SIZE, BlockHeader, file_size_for  # noqa: E402
from gds_kv_connector.maintenance.pool_scan import quarantine_dir  # noqa: E402

pytest_plugins = ["tests.support.fault_helpers"]

STRANGER = 12345  # a uid and gid no pool writer has
TEST_USER = "gdskvtest"


@pytest.fixture
def engine():
    e = PosixEngine(io_threads=2)
    yield e
    e.close()


def _saved(root: str, engine, keys: list[bytes], **kw) -> BlockPool:
    pool = fh.make_pool(root, geometry_note="trust test", **kw)
    kv = fh.make_kv(len(keys))
    out = open_store(pool, engine).save(keys, [b""] * len(keys), [fh.fill(kv, i, k) for i, k in enumerate(keys)])
    assert out.published == len(keys)
    return pool


def _quarantined(root: str) -> list[str]:
    return sorted(os.listdir(quarantine_dir(root)))


def _report(area: str, attacked: int, detected: int, quarantined: int) -> None:
    print(f"{area}: files attacked={attacked} detected={detected} quarantined={quarantined}")
    fh.record(area, trials=attacked, injected=attacked, detected=detected, quarantined=quarantined)


# -- 1. a load failure that would repeat is quarantined first -----------------------------------------
def _unprivileged_user() -> pwd.struct_passwd:
    """The unprivileged test user, made (without a home) where missing; skips where that is impossible."""
    if os.geteuid() != 0:
        pytest.skip("needs root: to make the unprivileged user and hand it the pool")
    try:
        return pwd.getpwnam(TEST_USER)
    except KeyError:
        pass
    if shutil.which("useradd") is None or subprocess.run(["useradd", "-M", TEST_USER], capture_output=True).returncode:
        pytest.skip(f"cannot create the unprivileged user {TEST_USER} (useradd)")
    return pwd.getpwnam(TEST_USER)


def _as_user(user: pwd.struct_passwd, fn) -> dict:
    """``fn()``'s dict from a forked child running as ``user`` (the interpreter under /root cannot be
    exec'ed by it, so the child keeps this one): a process to which permissions apply."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(rfd)
        try:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            out = fn()
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            out = {"crash": traceback.format_exc()}
        os.write(wfd, json.dumps(out).encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as fh_:
        data = fh_.read()
    os.waitpid(pid, 0)
    out = json.loads(data)
    assert "crash" not in out, out["crash"]
    return out


def _owner_loads(root: str, key: bytes) -> dict:
    """What one owner does with ``key``: match it, and if promised, pin it (as a load does)."""
    pool = fh.make_pool(root)
    matched = pool.count_present([key])
    if not matched:
        return {"matched": 0}
    try:
        pool.unpin_all(open_store(pool).pin([key]))
        return {"matched": matched, "loaded": True}
    except LoadFailure as exc:
        return {"matched": matched, "failure": exc.reason, "key": exc.key.hex()}


def test_unreadable_block_fails_once_quarantined_not_in_a_crash_loop(engine):
    """A block the owner can stat but not open (mode 000, EACCES): the first owner's load fails naming
    it and moves it aside; the next owner (a restarted server) no longer matches it."""
    user = _unprivileged_user()
    base = tempfile.mkdtemp(prefix="gdskv-trust-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "pool")
        key = fh.key_of("eacces")
        pool = _saved(root, engine, [key])
        for d, _dirs, files in os.walk(root):
            for name in (d, *(os.path.join(d, f) for f in files)):
                os.chown(name, user.pw_uid, user.pw_gid)
        os.chmod(pool.path_for(key), 0)
        first = _as_user(user, lambda: _owner_loads(root, key))
        second = _as_user(user, lambda: _owner_loads(root, key))
        moved = _quarantined(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert first["matched"] == 1 and first["key"] == key.hex(), first
    assert "Permission denied" in first["failure"] and "quarantined" in first["failure"], first
    assert len(moved) == 1 and moved[0].startswith(key.hex()), moved
    assert second == {"matched": 0}, "a restarted owner met the unreadable block again"
    _report("trust", attacked=1, detected=1, quarantined=len(moved))


def test_persistent_eio_on_a_promised_block_quarantines_it(tmp_path, engine):
    """Reads of one block keep failing with EIO past their retries: the load fails naming the block
    and the file leaves the key's name, so the next match is a miss, not the same failure again."""
    root = str(tmp_path / "pool")
    key = fh.key_of("eio")
    _saved(root, engine, [key])
    ops = FaultyFileOps()  # the reader's: it knows which file each descriptor it opened is
    ops.add("preadv", "eio", path_contains=key.hex())
    pool, faulty = fh.make_pool(root, ops=ops, index_ttl_s=0.0), PosixEngine(1, ops=ops)
    pins = open_store(pool).pin([key])
    try:
        with pytest.raises(LoadFailure) as info:
            open_store(pool, faulty).load(pins, [fh.make_kv(1).block_view(0)], verify=True, retries=1,
                        deadline=time.monotonic() + 10)
    finally:
        pool.unpin_all(pins)
        faulty.close()
    assert info.value.key == key and "quarantined" in info.value.reason
    assert not os.path.lexists(pool.path_for(key)) and len(_quarantined(root)) == 1
    assert fh.make_pool(root).count_present([key]) == 0
    _report("trust", attacked=1, detected=1, quarantined=1)


# -- 2. untrusted writers: a miss at match, never a load ----------------------------------------------
@pytest.mark.parametrize("attack", ["other_uid", "world_writable"])
def test_untrusted_key_directory_is_a_miss_at_match(tmp_path, engine, attack):
    """Blocks in a key directory another uid owns, or every user may write, are not matched (a fresh
    owner's match, count, absent and contains), while the blocks of trusted directories still are."""
    root = str(tmp_path / "pool")
    keys = [fh.key_of("dir", attack, i) for i in range(40)]
    pool = _saved(root, engine, keys)
    bad = pool.dir_for(keys[7])
    if attack == "other_uid":
        os.chown(bad, STRANGER, STRANGER)
    else:
        os.chmod(bad, 0o777)
    in_bad = [k for k in keys if pool.dir_for(k) == bad]
    fresh = fh.make_pool(root)
    first_bad = min(keys.index(k) for k in in_bad)
    assert fresh.count_present(keys) == first_bad
    assert all(fresh.absent(k) and not fresh.contains(k) for k in in_bad)
    assert fresh.count_present([k for k in keys if k not in in_bad]) == len(keys) - len(in_bad)
    _report("trust", attacked=len(in_bad), detected=len(in_bad), quarantined=0)


def _plant_stranger_copy(pool: BlockPool, src: bytes, key: bytes, uid: int, gid: int, mode: int) -> None:
    """A valid block of ``key`` (another key's bytes with this key's header: it verifies) at its name,
    owned by ``uid``:``gid`` with ``mode``: what a writer outside the pool could leave."""
    with open(pool.path_for(src), "rb") as f:
        data = bytearray(f.read())
    header = BlockHeader(pool.fingerprint, key, pool.payload_len, int.from_bytes(data[88:96], "little"), 1,
                         pool.tokens_per_block, time.time_ns())
    data[:HEADER_SIZE] = header.pack()
    path = pool.path_for(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chown(path, uid, gid)
    os.chmod(path, mode)


# (uid, gid, mode): another uid's file, whatever its mode; root's file every user may write; root's
# file a group other than the pool's may write
UNTRUSTED_FILES = {"other_uid_0666": (STRANGER, STRANGER, 0o666), "other_uid_0600": (STRANGER, STRANGER, 0o600),
                   "root_0666": (0, 0, 0o666), "group_writable_0660": (0, STRANGER, 0o660)}


@pytest.mark.parametrize("case", list(UNTRUSTED_FILES))
def test_untrusted_block_file_is_never_loaded(tmp_path, engine, case):
    """A block file that verifies but that a writer outside the pool made or could change: not present
    where its stat is seen (contains), and quarantined before a byte is read where a load meets it."""
    root = str(tmp_path / "pool")
    src, key = fh.key_of("genuine", case), fh.key_of("forged", case)
    pool = _saved(root, engine, [src])
    _plant_stranger_copy(pool, src, key, *UNTRUSTED_FILES[case])
    fresh = fh.make_pool(root)
    assert not fresh.contains(key), "an untrusted file counted as present"
    with pytest.raises(LoadFailure) as info:
        fresh.unpin_all(open_store(fresh).pin([key]))
    assert info.value.key == key and "untrusted" in info.value.reason, info.value.reason
    assert not os.path.lexists(pool.path_for(key)) and len(_quarantined(root)) == 1
    assert fresh.count_present([key]) == 0 and fresh.count_present([src]) == 1
    _report("trust", attacked=1, detected=1, quarantined=1)


@pytest.mark.parametrize("case", list(UNTRUSTED_FILES))
def test_an_untrusted_block_file_is_a_miss_at_match_not_a_promise(tmp_path, engine, case, native_impl):
    """The match's one stat per key (the C loops, or the Python one without them) sees the owner and
    mode it already returns: an untrusted file in a trusted directory ends the matched run, so it is
    never promised and no load of it can fail the process (the load would refuse it)."""
    root = str(tmp_path / "pool")
    genuine = [fh.key_of("genuine", case, i) for i in range(3)]
    pool = _saved(root, engine, genuine)
    for key in genuine[1:]:  # the second and third blocks were replaced by files a stranger could make
        os.unlink(pool.path_for(key))
        _plant_stranger_copy(pool, genuine[0], key, *UNTRUSTED_FILES[case])
    fresh = fh.make_pool(root)
    assert fresh.count_present(genuine) == 1, "an untrusted file was counted as present at match time"
    assert fresh.absent(genuine[1])
    _report("trust", attacked=2, detected=2, quarantined=0)


def test_share_group_trusts_the_group_of_the_pool_root(tmp_path, engine):
    """In a pool made for sharing (TLLM_GDS_KV_SHARE_GROUP: setgid, group-writable directories), another
    uid's file carrying the root's group (one this process is in) is a pool writer's, also for an owner
    or verify run without the setting; in a pool not made for sharing, the same file is untrusted."""
    planted = {}
    for share in (True, False):
        root = str(tmp_path / f"pool-{share}")
        src, key = fh.key_of("share-src"), fh.key_of("share")
        pool = _saved(root, engine, [src], share_group=share)
        _plant_stranger_copy(pool, src, key, STRANGER, os.stat(root).st_gid, 0o640)
        planted[share] = (root, key)
    root, key = planted[True]
    assert fh.make_pool(root, share_group=True).contains(key) and fh.make_pool(root).contains(key)
    assert verify(root, workers=1, progress=False, share_group=False)["ok"] == 2
    root, key = planted[False]
    assert not fh.make_pool(root).contains(key)
    _report("trust", attacked=1, detected=1, quarantined=0)


@pytest.mark.parametrize("which", ["layout", "fingerprint"])
def test_owner_refuses_a_pool_whose_upper_directories_anyone_may_write(tmp_path, engine, which):
    root = str(tmp_path / "pool")
    pool = _saved(root, engine, [fh.key_of("upper")])
    d = os.path.dirname(pool.fp_dirs[0]) if which == "layout" else pool.fp_dirs[0]
    os.chmod(d, 0o777)
    with pytest.raises(PoolError, match="writable by every user"):
        fh.make_pool(root)
    _report("trust", attacked=1, detected=1, quarantined=0)


# -- 3. junk at a block's name: the save moves it aside and publishes ---------------------------------
def _plant_junk(pool: BlockPool, key: bytes, kind: str, other: str) -> None:
    path = pool.path_for(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "directory":
        os.mkdir(path)
        with open(os.path.join(path, "inside"), "wb") as f:
            f.write(b"x")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_to_block":
        os.symlink(other, path)
    elif kind == "dangling_symlink":
        os.symlink(path + ".nowhere", path)
    elif kind == "short_file":
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
    else:  # untrusted: a stranger's world-writable file of the right size
        with open(other, "rb") as f, open(path, "wb") as g:
            g.write(f.read())
        os.chown(path, STRANGER, STRANGER)
        os.chmod(path, 0o666)


JUNK = ["directory", "fifo", "symlink_to_block", "dangling_symlink", "short_file", "untrusted"]
_IS_KIND = {"directory": os.path.isdir, "fifo": lambda p: stat.S_ISFIFO(os.lstat(p).st_mode),
            "symlink_to_block": os.path.islink, "dangling_symlink": os.path.islink,
            "short_file": os.path.isfile, "untrusted": os.path.isfile}


@pytest.mark.parametrize("kind", JUNK)
def test_save_moves_junk_aside_and_publishes(tmp_path, engine, kind, monkeypatch):
    """Junk at a key's name made every save of it a lost race, for ever: now the save moves it to the
    quarantine (whole and unopened) and publishes, and the block loads byte-exact.  A regular file of
    a trusted writer that changed less than STALE_ATTR_S ago is first left alone (it may be another
    node's block seen through a stale attribute cache); it is junk once older than that."""
    import gds_kv_connector.store.pool as pool_mod

    root = str(tmp_path / "pool")
    other, key = fh.key_of("junk-other", kind), fh.key_of("junk", kind)
    pool = _saved(root, engine, [other], index_ttl_s=0.0)
    _plant_junk(pool, key, kind, pool.path_for(other))
    kv = fh.make_kv(3)
    if kind == "short_file":  # young: a lost race for now, nothing moved
        out = open_store(pool, engine).save([key], [b""], [fh.fill(kv, 0, key)])
        assert (out.published, out.lost_race) == (0, 1) and _quarantined(root) == [], out
        monkeypatch.setattr(pool_mod, "STALE_ATTR_S", 0.0)  # as it is once the window has passed
    out = open_store(pool, engine).save([key], [b""], [fh.fill(kv, 0, key)])
    assert (out.published, out.lost_race, out.failed) == (1, 0, []), out
    moved = _quarantined(root)
    assert len(moved) == 1 and _IS_KIND[kind](os.path.join(quarantine_dir(root), moved[0])), moved
    fh.verify_file(pool.path_for(key))
    fh.verify_file(pool.path_for(other))  # a link's target is never touched
    fh.load_and_compare(pool, engine, kv, [key], first_block=1)
    _report("junk", attacked=1, detected=1, quarantined=len(moved))


def test_arena_save_moves_junk_aside_and_publishes_its_reference(tmp_path, engine):
    """The same for a reference file linked under a batch's keys."""
    root = str(tmp_path / "pool")
    pool = BlockPool((root,), fh.FINGERPRINT, fh.PAYLOAD_LEN, fh.TOKENS_PER_BLOCK, refs=True, index_ttl_s=0.0)
    pool.arena = SlotArena(pool, engine, 8 * pool.file_size, 8 * pool.file_size, 0.0, mapped=False)
    pool.arena.start(background=False)
    try:
        keys = [fh.key_of("arena-junk", i) for i in range(3)]
        for k, kind in zip(keys, ("directory", "fifo")):
            _plant_junk(pool, k, kind, "")
        kv = fh.make_kv(6)
        out = open_store(pool, engine).save(keys, [b""] * 3, [fh.fill(kv, i, k) for i, k in enumerate(keys)])
        assert (out.published, out.already_present, out.failed) == (3, 0, []), out
        assert len(_quarantined(root)) == 2
        fresh = BlockPool((root,), fh.FINGERPRINT, fh.PAYLOAD_LEN, fh.TOKENS_PER_BLOCK, refs=True)
        assert fresh.count_present(keys) == 3
        fh.load_and_compare(pool, engine, kv, keys, first_block=3)
    finally:
        pool.arena.close()
    _report("junk", attacked=2, detected=2, quarantined=2)


# -- 3 and 4. verify: junk and untrusted files out, and no read larger than the geometry --------------
def test_verify_quarantines_junk_and_untrusted_files(tmp_path, engine):
    root = str(tmp_path / "pool")
    keys = [fh.key_of("verify", i) for i in range(4)]
    pool = _saved(root, engine, keys)
    planted = {kind: fh.key_of("verify-junk", kind) for kind in ("directory", "fifo", "dangling_symlink",
                                                                 "untrusted")}
    for kind, k in planted.items():
        _plant_junk(pool, k, kind, pool.path_for(keys[0]))
    report = verify(root, workers=2, progress=False, quarantine=False)
    assert report["reasons"] == {"junk": 3, "untrusted": 1} and report["quarantined"] == 0
    assert all(os.path.lexists(pool.path_for(k)) for k in planted.values()), "--no-quarantine moved files"
    result = verify(root, workers=2, progress=False)
    assert result["reasons"] == {"junk": 3, "untrusted": 1} and result["ok"] == 4, result
    assert result["quarantined"] == 4 and result["exit_code"] == EXIT_PROBLEMS
    assert not any(os.path.lexists(pool.path_for(k)) for k in planted.values())
    again = verify(root, workers=2, progress=False)
    assert again["bad"] == 0 and again["ok"] == 4 and again["exit_code"] == EXIT_OK
    _report("verify", attacked=len(planted), detected=result["bad"], quarantined=result["quarantined"])


_VERIFY_CHILD = """
import json, sys
from gds_kv_connector.maintenance.verify import verify
r = verify(sys.argv[1], workers=1, progress=False)
print(json.dumps({"reasons": r["reasons"], "bytes_read": r["bytes_read"], "quarantined": r["quarantined"],
                  # VmHWM: this process's own peak (ru_maxrss carries the parent's across fork and exec)
                  "maxrss_kib": next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))}))
"""


def test_verify_never_allocates_more_than_the_geometry_payload(tmp_path, engine):
    """A sparse file whose valid header claims a 1 GiB payload (its size agrees): verify used to read it
    all into memory (twice); now the header disagrees with the fingerprint's geometry and nothing is read."""
    root = str(tmp_path / "pool")
    pool = _saved(root, engine, [fh.key_of("geometry-ok")])
    key, claim = fh.key_of("geometry-huge"), 1 << 30
    path = pool.path_for(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(BlockHeader(pool.fingerprint, key, claim, 0, 1, pool.tokens_per_block, time.time_ns()).pack())
        f.truncate(file_size_for(claim))
    os.chmod(path, 0o600)
    repo = REPO
    proc = subprocess.run([sys.executable, "-c", _VERIFY_CHILD, root], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    print(f"verify child: peak RSS {out['maxrss_kib'] // 1024} MiB, {out['bytes_read']} bytes read")
    assert out["reasons"] == {"header": 1} and out["quarantined"] == 1, out
    assert out["bytes_read"] < 2 * pool.file_size, out
    assert out["maxrss_kib"] < 512 * 1024, f"verify peaked at {out['maxrss_kib'] // 1024} MiB"
    _report("verify", attacked=1, detected=1, quarantined=out["quarantined"])
