"""The system calls the pool and the POSIX engine make, behind one object.

Everything that touches pool files goes through a :class:`FileOps`, so the fault-injection suite
can substitute stalls, EIO, ENOSPC and short transfers without patching ``os``.
"""

from __future__ import annotations

import os
import stat

from gds_kv_connector.format import native
from gds_kv_connector.format.trust import why_untrusted


class FileOps:
    """Thin pass-through to ``os``; subclass to inject faults."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, buf, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        return os.pread(fd, n, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def stat(self, path: str) -> os.stat_result:
        return os.lstat(path)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst, follow_symlinks=False)

    def link_keys(self, src: str, dirs: tuple[str, ...], keys: list[bytes], suffix: str) -> list[OSError | None]:
        """Link ``src`` under each key's name ``f"{dirs[key[0]]}/{key.hex()}{suffix}"`` (256 dirs);
        the error per key, None where it was linked.

        One C loop where the extension is built, unless a subclass overrides :meth:`link` (fault
        injection), which then sees every call."""
        if type(self).link is FileOps.link:
            errnos = native.link_keys(src, dirs, keys, suffix)
            if errnos is not None:
                if not any(errnos):
                    return [None] * len(keys)
                # shaped as os.link raises them (filename src, filename2 dst), as the loop below returns
                return [None if e == 0 else OSError(e, os.strerror(e), src, None, key_name(dirs, k, suffix))
                        for e, k in zip(errnos, keys)]
        out: list[OSError | None] = []
        for k in keys:
            try:
                self.link(src, key_name(dirs, k, suffix))
                out.append(None)
            except OSError as exc:
                out.append(exc)
        return out

    def present_run(self, dirs: tuple[str, ...], keys: list[bytes], start: int, suffix: str,
                    trust: native.Trust | None = None) -> list[int]:
        """Sizes of the regular files named for ``keys[start:]`` (:func:`key_name`), up to the first
        that is missing, not a regular file, fails to stat (links never followed) or, with ``trust``
        (uids, gids), was made by no writer it names (:func:`~gds_kv_connector.format.trust.why_untrusted`).

        One C call where the extension is built: it keeps the GIL for the first few stats and splits
        a long run over threads (see ``present_run`` in csrc/native.c: the executor thread calls this
        when it matches a prompt); a subclass that overrides :meth:`stat` (fault injection) sees
        every call."""
        if type(self).stat is FileOps.stat:
            sizes = native.present_run(dirs, keys, start, suffix, trust)
            if sizes is not None:
                return sizes
        run = keys[start:]
        if any(type(k) is not bytes or len(k) != 32 for k in run):  # as the C loop: names only from 32-byte keys
            raise TypeError("keys must be 32-byte bytes")
        out: list[int] = []
        for k in run:
            try:
                st = self.stat(key_name(dirs, k, suffix))
            except OSError:
                break
            if not stat.S_ISREG(st.st_mode) or (trust is not None and why_untrusted(*trust, st) is not None):
                break
            out.append(st.st_size)
        return out

    def chain_present(self, prev: bytes, tokens: list[int], tokens_per_block: int, num_blocks: int,
                      dirs: tuple[str, ...], suffix: str,
                      trust: native.Trust | None = None) -> tuple[list[bytes], list[int]] | None:
        """The keys of ``num_blocks`` blocks of ``tokens`` (``prev``: the key before the first) and
        :meth:`present_run` over them from the first, in one C call whose stats follow the hashing
        on other threads; None where it cannot run (the extension is missing, or a subclass
        overrides :meth:`stat`), and the caller then keys and stats one step after the other."""
        if type(self).stat is not FileOps.stat:
            return None
        return native.chain_present(prev, tokens, 0, tokens_per_block, num_blocks, dirs, suffix, trust)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fchmod(self, fd: int, mode: int) -> None:
        os.fchmod(fd, mode)


def key_name(dirs: tuple[str, ...], key: bytes, suffix: str) -> str:
    """A key's file name: the directory its first byte selects, then its hex digits and the suffix;
    the format pool.path_for (inlined there: it runs per block) and native.link_keys also build."""
    return f"{dirs[key[0]]}/{key.hex()}{suffix}"


def write_all(ops: FileOps, fd: int, data, offset: int) -> None:
    """pwrite until every byte is written; a zero-byte write is an error, never a spin."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = ops.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(5, f"pwrite wrote {n} bytes at offset {offset + done}")
        done += n


def read_exact(ops: FileOps, fd: int, buf, offset: int) -> None:
    """preadv until the buffer is full; end of file first is a truncated file."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = ops.preadv(fd, view[done:], offset + done)
        if n <= 0:
            raise EOFError(f"file ended after {offset + done} bytes, {len(view) - done} short")
        done += n
