"""Releasing a pin never fails a load: close(2) of a read-only descriptor that reports an error (ESTALE
from a shared filesystem whose file another node removed) has released it all the same."""

import errno
import os

from gds_kv_connector.engines.fileops import FileOps
from tests.support.fault_helpers import key_of, make_pool


class _StaleClose(FileOps):
    def close(self, fd):
        super().close(fd)
        raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))


def test_a_close_that_fails_releases_the_pin_without_raising(tmp_path):
    pool = make_pool(str(tmp_path), ops=_StaleClose())
    key = key_of("unpin")
    pool.makedirs(pool.dir_for(key))
    with open(pool.path_for(key), "wb") as f:
        f.truncate(pool.file_size)
    pin = pool.pin(key)
    fd = pin.fd
    pool.unpin(pin)
    assert pin.fd == -1
    try:
        os.fstat(fd)
    except OSError as exc:
        assert exc.errno == errno.EBADF  # closed, not leaked
    else:
        raise AssertionError("the descriptor was left open")
