"""KvikIO engine: CUDA KV blocks moved between HBM and pool files by KvikIO, checksummed on the GPU.

KvikIO takes one of three paths, and which one matters for both speed and honesty of reports:
real GPUDirect Storage, cuFile's own POSIX compat mode (libcufile without nvidia-fs), or KvikIO's
POSIX path with a pinned bounce buffer (KvikIO compat mode).  Switching KvikIO's compat mode off
can make every file open fail on hosts where cuFile cannot register handles (ext4 without
nvidia-fs: "udev property not found", then "file descriptor is not registered"), and on a host
with libcufile but no usable driver it can hang.  So before the first transfer the engine probes
cuFile once on the pool's filesystem, under a timeout, and falls back to KvikIO's POSIX path with
the reason recorded if the probe fails; :meth:`KvikioEngine.data_path` reports the outcome.
Wherever KvikIO would take its POSIX path, block files are moved by :mod:`.staged_files` instead
(``TLLM_GDS_KV_COMPAT_IO=staged``, the default): one O_DIRECT read per file instead of a CuFile,
a bounce buffer and buffered reads per file, which made cold disk loads a third to a half faster.

KvikIO and CuPy are imported only when an engine is built, never by importing the package.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import secrets
import threading
from typing import Any, Callable

import torch

from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.engines.base import InTime, IoEngine, TransferItem, ViewsRead, expired_check, header_io
from gds_kv_connector.engines.host_dma import CudaHostDma
from gds_kv_connector.engines.staged_files import StagedFileIo

log = logging.getLogger(__name__)
_OPS = FileOps()  # the header's own I/O beside KvikIO's payload I/O

DEFAULT_TASK_SIZE = 4 << 20
PROBE_TIMEOUT_S = 20.0
# Above KvikIO's 16 KiB gds_threshold, below which pread/pwrite skip cuFile: the probe must take
# the path block transfers take.
_PROBE_BYTES = 64 << 10
_PROBE_OFFSET = 4096  # where a block file's payload starts, after its header page
# KvikIO raises RuntimeError with the system error text; store.blocks retries and counts failures by
# errno, so the errors it acts on are turned back into OSError.
_ERRNO_BY_TEXT = {os.strerror(code): code for code in
                  (errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT,
                   errno.EROFS, errno.EBADF, errno.ENOENT)}


def probe_cufile(dirpath: str, timeout_s: float = PROBE_TIMEOUT_S,
                 device: torch.device | None = None) -> tuple[bool, str]:
    """Open, write and read back a small file in ``dirpath`` through cuFile, with compat mode off.

    Compat mode is forced off for the probe because under AUTO a failing handle registration is
    silently absorbed per file, which is exactly what the probe must see.  The attempt runs on a
    daemon thread and is abandoned after ``timeout_s``, because on a host with libcufile but no
    working driver cuFile can block forever.  Returns (ok, reason).
    """
    import kvikio
    import kvikio.defaults

    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    outcome: list[tuple[bool, str]] = []

    def attempt() -> None:
        try:
            outcome.append(_probe_once(kvikio, dirpath, device))
        except BaseException as exc:  # noqa: BLE001 - any failure is the probe's answer
            outcome.append((False, f"{type(exc).__name__}: {exc}".strip()))

    previous = kvikio.defaults.get("compat_mode")
    kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF)
    try:
        worker = threading.Thread(target=attempt, name="gdskv-cufile-probe", daemon=True)
        worker.start()
        worker.join(timeout_s)
    finally:
        kvikio.defaults.set("compat_mode", previous)
    if not outcome:
        return False, f"cuFile probe in {dirpath} did not finish within {timeout_s:g} s"
    return outcome[0]


def _probe_once(kvikio: Any, dirpath: str, device: torch.device) -> tuple[bool, str]:
    path = os.path.join(dirpath, f".gdskv-probe-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, _PROBE_OFFSET + _PROBE_BYTES)
        src = (torch.arange(_PROBE_BYTES, dtype=torch.int32, device=device) % 251).to(torch.uint8)
        dst = torch.zeros_like(src)
        torch.cuda.synchronize(device)
        # The same reopen through /proc the engine does, so registration is tested on the same terms.
        f = kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")
        try:
            wrote = f.pwrite(src, file_offset=_PROBE_OFFSET).get()
            got = f.pread(dst, file_offset=_PROBE_OFFSET).get()
        finally:
            f.close()
        if wrote != _PROBE_BYTES or got != _PROBE_BYTES:
            return False, f"short cuFile transfer in {dirpath}: wrote {wrote}, read {got} of {_PROBE_BYTES} bytes"
        if not torch.equal(src, dst):
            return False, f"cuFile read back different bytes than it wrote in {dirpath}"
        return True, f"cuFile registered a handle and round-tripped {_PROBE_BYTES >> 10} KiB in {dirpath}"
    finally:
        os.close(fd)
        os.unlink(path)


class KvikioEngine(IoEngine):
    name = "kvikio"

    def __init__(self, io_threads: int = 16, device: torch.device | None = None,
                 probe_dir: str | None = None, compat_io: str = "staged") -> None:
        """``probe_dir`` should be the pool directory, so cuFile is probed on the filesystem it will
        serve; without it the probe runs in the directory of the first file transferred.
        ``compat_io`` (TLLM_GDS_KV_COMPAT_IO) picks who moves files when KvikIO would take its POSIX
        path: ``staged`` (:mod:`.staged_files`) or ``kvikio``."""
        if compat_io not in ("staged", "kvikio"):
            raise ValueError(f"compat_io must be staged or kvikio, not {compat_io!r}")
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults

        self._kvikio = kvikio
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        if kvikio.defaults.get("num_threads") != io_threads:
            kvikio.defaults.set("num_threads", io_threads)
        if "KVIKIO_TASK_SIZE" not in os.environ and kvikio.defaults.get("task_size") != DEFAULT_TASK_SIZE:
            kvikio.defaults.set("task_size", DEFAULT_TASK_SIZE)
        _apply_compat_env(kvikio)
        self._probe_lock = threading.Lock()
        self._host_dma: CudaHostDma | None = None
        self._io_threads, self._compat_io = io_threads, compat_io
        self._staged: StagedFileIo | None = None
        # When KvikIO never calls cuFile there is nothing to probe.
        self._probed = kvikio.defaults.is_compat_mode_preferred()
        self._probe_reason = ""
        self._fallback: str | None = None
        self._log_start()
        if probe_dir is not None:
            self._ensure_probed(probe_dir)

    # -- IoEngine ---------------------------------------------------------------------------------
    def write(self, items: list[TransferItem], in_time: InTime | None = None,
              views_read: ViewsRead | None = None) -> list[BaseException | None]:
        return self._transfer(items, write=True, in_time=in_time, views_read=views_read)

    def read(self, items: list[TransferItem], in_time: InTime | None = None) -> list[BaseException | None]:
        return self._transfer(items, write=False, in_time=in_time)

    def checksums(self, views: list[torch.Tensor], load: bool = False) -> list[int]:
        from gds_kv_connector.engines.gpu_checksum import checksums_device

        return checksums_device(views)

    def register_host(self, addr: int, nbytes: int, read_only: bool) -> None:
        self._dma().register(addr, nbytes, read_only)

    def unregister_host(self, addr: int) -> None:
        self._dma().unregister(addr)

    def copy_to_host(self, pairs: list[tuple[int, torch.Tensor]], pitch: int) -> None:
        self._dma().copy(pairs, pitch, to_host=True)

    def copy_from_host(self, pairs: list[tuple[int, torch.Tensor]], pitch: int) -> None:
        self._dma().copy(pairs, pitch, to_host=False)

    def close(self) -> None:
        if self._staged is not None:
            self._staged.close()

    def _dma(self) -> CudaHostDma:
        if self._host_dma is None:
            with self._probe_lock:
                if self._host_dma is None:
                    self._host_dma = CudaHostDma(self.device)
        return self._host_dma

    def data_path(self) -> str:
        kv = self._kvikio
        posix = "staged-direct" if self._compat_io == "staged" else "kvikio-posix"
        if self._fallback is not None:
            return f"{posix} (fallback: {self._fallback})"
        if kv.defaults.is_compat_mode_preferred():
            if kv.defaults.get("compat_mode") == kv.CompatMode.ON:
                return f"{posix} (KVIKIO_COMPAT_MODE=ON)"
            return (f"{posix} (KVIKIO_COMPAT_MODE=AUTO chose KvikIO's POSIX path: libcufile is not loadable, "
                    "/run/udev is unreadable, or this is WSL)")
        probe = self._probe_reason if self._probed else "cuFile is probed at the first transfer"
        try:
            gds = bool(kv.cufile_driver.get("is_gds_available"))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            return f"cufile-compat (is_gds_available unreadable: {exc}; {probe})"
        if gds:
            return f"gds (nvidia-fs is loaded; {probe})"
        return ("cufile-compat (libcufile is used but nvidia-fs is not loaded, "
                f"so cuFile runs its own POSIX mode; {probe})")

    # -- internals --------------------------------------------------------------------------------
    def _log_start(self) -> None:
        kv = self._kvikio
        log.info("KvikIO %s, libcufile %s, compat_mode=%s (KVIKIO_COMPAT_MODE=%s, compat preferred: %s), "
                 "is_gds_available=%s, allow_compat_mode=%s, num_threads=%s, task_size=%s",
                 kv.__version__, _guarded(kv.cufile_driver.libcufile_version),
                 kv.defaults.get("compat_mode"), os.environ.get("KVIKIO_COMPAT_MODE", "unset"),
                 kv.defaults.is_compat_mode_preferred(),
                 _guarded(lambda: kv.cufile_driver.get("is_gds_available")),
                 _guarded(lambda: kv.cufile_driver.get("allow_compat_mode")),
                 kv.defaults.get("num_threads"), kv.defaults.get("task_size"))

    def _ensure_probed(self, dirpath: str) -> None:
        """Probe once; every transfer waits here until the process-wide compat mode is final."""
        if self._probed:
            return
        with self._probe_lock:
            if self._probed:
                return
            ok, reason = probe_cufile(dirpath, device=self.device)
            self._probe_reason = reason
            if ok:
                log.info("cuFile probe: %s", reason)
            else:
                self._kvikio.defaults.set("compat_mode", self._kvikio.CompatMode.ON)
                self._fallback = reason
                log.warning("cuFile probe failed (%s); moving blocks on KvikIO's POSIX path", reason)
            self._probed = True

    def _transfer(self, items: list[TransferItem], write: bool, in_time: InTime | None = None,
                  views_read: ViewsRead | None = None) -> list[BaseException | None]:
        if not items:
            return []
        if not self._probed:
            try:
                self._ensure_probed(os.path.dirname(os.readlink(f"/proc/self/fd/{items[0].fd}")))
            except Exception as exc:  # noqa: BLE001 - the batch fails, the engine stays usable
                return [_as_error(exc) for _ in items]
        staged = self._staged_io()
        if staged is not None:  # it stages the payloads: the views are free once they are copied
            return staged.write(items, in_time, views_read) if write else staged.read(items, in_time)
        return self._direct(items, write, in_time)  # KvikIO reads the views until its writes return

    def _direct(self, items: list[TransferItem], write: bool, in_time: InTime | None) -> list[BaseException | None]:
        """Every item through KvikIO's own ``CuFile`` reads and writes (GDS, or its POSIX path)."""
        flags = "r+" if write else "r"
        handles: dict[int, Any] = {}  # one per descriptor: slots of one arena slab share it

        def start(item: TransferItem) -> Any:
            view = _byte_view(item.view)
            header_io(item, write, _OPS.pwrite, _OPS.preadv)
            handle = handles.get(item.fd)
            if handle is None:
                # The pool's fds are O_WRONLY (saves) or O_RDONLY (loads) and have no O_DIRECT;
                # reopening the same inode through /proc lets KvikIO open it its own way.
                handle = handles[item.fd] = self._kvikio.CuFile(f"/proc/self/fd/{item.fd}", flags)
            return (handle.pwrite if write else handle.pread)(view, file_offset=item.offset)
        try:
            return run_windowed(items, start, 2 * self._io_threads, write, in_time)
        finally:
            for handle in handles.values():
                try:
                    handle.close()
                except Exception as exc:  # noqa: BLE001 - the transfer's outcome is already known
                    log.debug("closing a KvikIO handle failed: %s", exc)

    def _staged_io(self) -> StagedFileIo | None:
        """The staged O_DIRECT path, where KvikIO would take its POSIX path and it is not opted out."""
        if self._staged is None and self._compat_io == "staged" and (
                self._fallback is not None or self._kvikio.defaults.is_compat_mode_preferred()):
            dma = self._dma()
            with self._probe_lock:
                if self._staged is None:
                    self._staged = StagedFileIo(
                        lambda pairs, pitch: dma.copy(pairs, pitch, to_host=True),
                        lambda pairs, pitch: dma.copy(pairs, pitch, to_host=False),
                        dma.register, dma.unregister, self._io_threads)
        return self._staged


def run_windowed(items: list[TransferItem], start: Callable[[TransferItem], Any], window: int, write: bool,
                 in_time: InTime | None = None) -> list[BaseException | None]:
    """Start each item's I/O (``start`` returns a KvikIO future, or raises) with at most ``window``
    started and not yet waited for, the oldest waited for first; the error of each item, or None.

    KvikIO's thread pool is one FIFO queue for every caller: a save batch handed over whole would
    put a load's reads behind all of its writes, and a deadline could stop none of them.  Twice the
    pool's threads in flight per call keeps every thread busy.  Items not started once ``in_time``
    returns False fail with :class:`~.base.WriteExpired` (:class:`~.base.ReadStopped` for reads)."""
    results: list[BaseException | None] = [None] * len(items)
    pending: collections.deque[tuple[int, Any]] = collections.deque()
    try:
        for i, item in enumerate(items):
            if len(pending) >= window:
                _settle(pending[0], items, results, write)
                pending.popleft()
            try:
                expired_check(in_time, reading=not write)
                pending.append((i, start(item)))
            except Exception as exc:  # noqa: BLE001 - reported per item
                results[i] = _as_error(exc)
        while pending:
            _settle(pending[0], items, results, write)
            pending.popleft()
    finally:
        # Only reached with futures left on an unexpected BaseException: a handle must outlive
        # its futures, so let them finish before the caller closes it.
        for _, future in pending:
            try:
                future.get()
            except BaseException:  # noqa: BLE001 - already failing
                pass
    return results


def _settle(entry: tuple[int, Any], items: list[TransferItem], results: list[BaseException | None],
            write: bool) -> None:
    i, future = entry
    try:
        moved, error = future.get(), None
    except Exception as exc:  # noqa: BLE001 - reported per item
        moved, error = 0, _as_error(exc)
    expected = items[i].view.numel() * items[i].view.element_size()
    if error is None and moved != expected:
        error = (OSError(errno.EIO, f"short write: {moved} of {expected} bytes") if write
                 else EOFError(f"short read: {moved} of {expected} bytes at offset {items[i].offset}"))
    results[i] = error


def _apply_compat_env(kvikio: Any) -> None:
    """Make KVIKIO_COMPAT_MODE as set now authoritative.

    KvikIO reads it once, at import; an engine built later in the same process (a restart of
    the connector, a test) must still get the mode its environment asks for.
    """
    raw = os.environ.get("KVIKIO_COMPAT_MODE", "").strip().lower()
    mode = {"on": "ON", "true": "ON", "yes": "ON", "1": "ON", "off": "OFF", "false": "OFF", "no": "OFF",
            "0": "OFF", "auto": "AUTO"}.get(raw)
    if mode is not None and kvikio.defaults.get("compat_mode") != getattr(kvikio.CompatMode, mode):
        kvikio.defaults.set("compat_mode", getattr(kvikio.CompatMode, mode))


def _byte_view(view: torch.Tensor) -> torch.Tensor:
    """A uint8 view, because torch cannot export FP8 tensors through __cuda_array_interface__."""
    if view.device.type != "cuda":
        raise ValueError(f"the kvikio engine moves CUDA blocks only, not {view.device}; use the posix engine")
    if not view.is_contiguous():
        raise ValueError("block views must be contiguous")
    return view if view.dtype == torch.uint8 else view.reshape(-1).view(torch.uint8)


def _as_error(exc: Exception) -> BaseException:
    """Map KvikIO's RuntimeErrors onto what store.blocks acts on: EOFError for a short file (it
    quarantines the block) and OSError with an errno (it retries transient ones)."""
    text = str(exc)
    if "EOF" in text:
        return EOFError(text)
    if isinstance(exc, OSError):
        return exc
    for message, code in _ERRNO_BY_TEXT.items():
        if message in text:
            err = OSError(code, text)
            err.__cause__ = exc
            return err
    return exc


def _guarded(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a start-up log line must not fail the engine
        return f"unavailable ({exc})"
