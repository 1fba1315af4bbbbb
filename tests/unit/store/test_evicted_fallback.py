"""On a shared filesystem a load finds a block an evictor just took out of the lookup path.

Another node's client can match a block from its caches after this node's evictor removed it; on such
a filesystem evictors rename the block into its fingerprint directory's ``evicted/`` and remove it only
after EVICTED_KEEP_S, and a pin whose name is gone opens it there.  The GlusterFS case runs in
tests/integration/test_shared_fs.py; here a local pool is told it is shared.
"""

import errno
import os

import pytest

from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.format.layout import evicted_path
from tests.support.fault_helpers import key_of, make_pool


def _block_at(path: str, size: int) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return os.stat(path).st_ino


def test_a_pin_opens_the_evicted_copy_on_a_shared_pool(tmp_path):
    pool = make_pool(str(tmp_path))
    pool.keeps_evicted = True
    key = key_of("evicted")
    ino = _block_at(evicted_path(pool.fp_dirs[0], key), pool.file_size)
    pin = pool.pin(key)
    assert pin.fd >= 0 and os.fstat(pin.fd).st_ino == ino
    pool.unpin(pin)


def test_the_name_comes_first(tmp_path):
    pool = make_pool(str(tmp_path))
    pool.keeps_evicted = True
    key = key_of("both")
    _block_at(evicted_path(pool.fp_dirs[0], key), pool.file_size)
    ino = _block_at(pool.path_for(key), pool.file_size)
    pin = pool.pin(key)
    assert os.fstat(pin.fd).st_ino == ino
    pool.unpin(pin)


def test_a_local_pool_never_looks_there(tmp_path):
    pool = make_pool(str(tmp_path))
    assert not pool.keeps_evicted  # tmp_path is on a local filesystem
    key = key_of("local")
    _block_at(evicted_path(pool.fp_dirs[0], key), pool.file_size)
    with pytest.raises(FileNotFoundError):
        pool.pin(key)


class _StaleName(FileOps):
    """A client whose cached handle for the name is stale: ESTALE for it, the server's answer elsewhere."""

    def open(self, path, flags, mode=0o600):
        if "/evicted/" not in path:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), path)
        return super().open(path, flags, mode)


def test_a_stale_handle_at_the_name_is_answered_from_the_evicted_copy(tmp_path):
    pool = make_pool(str(tmp_path), ops=_StaleName())
    pool.keeps_evicted = True
    key = key_of("stale")
    _block_at(evicted_path(pool.fp_dirs[0], key), pool.file_size)
    pool.unpin(pool.pin(key))
    other = key_of("nowhere")
    with pytest.raises(OSError) as got:
        pool.pin(other)
    assert got.value.errno == errno.ESTALE  # the name's own error when the block is in neither place
