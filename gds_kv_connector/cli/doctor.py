"""``gds-kv doctor``: what this machine can do for the connector's data path, and why.

Whether bytes really go GPU-to-NVMe depends on a chain of facts that fail silently: KvikIO must
import and not prefer its compat mode, libcufile must find nvidia-fs, the pool's filesystem must
be one GDS serves, and cuFile must register handles there.  Each link is reported on its own so
that a slow run can be traced to the link that broke.

Every check is bounded: KvikIO and cuFile calls run on daemon threads with timeouts, because on a
host with libcufile but no usable driver they can block forever, and ``driver_open`` is never
called.  Torch is imported only where an NVIDIA driver is loaded (without one it could see no
device, and its import alone takes seconds), so on a CPU-only machine the report is complete in well
under a second.

Each root must be a directory this process can create files in (or one it can create), with room
for the slot arena: ``gds-kv doctor`` exits 1 and ``gds-kv settings --check`` fails where one is not.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import mmap
import os
import secrets
import stat
import sys
import threading
from typing import Any, Callable

from gds_kv_connector.format import native
from gds_kv_connector.store.arena import HOST_FS_TYPES, slab_kind
from gds_kv_connector.store.pool import file_kind
from gds_kv_connector.util.mounts import mount_of
from gds_kv_connector.config.settings import Settings, SettingsError

CALL_TIMEOUT_S = 15.0
# Where a loaded NVIDIA driver shows (its kernel module; its device; WSL's GPU device): without one
# torch sees no CUDA device, so it is not imported to be told so
NVIDIA_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg")
# ext4 and XFS on local NVMe, plus the distributed filesystems with vendor GDS support.
GDS_FILESYSTEMS = frozenset({"ext4", "xfs", "lustre", "nfs", "nfs4", "wekafs", "gpfs", "beegfs"})
_ENV_KEYS = ("KVIKIO_COMPAT_MODE", "KVIKIO_NTHREADS", "KVIKIO_TASK_SIZE", "KVIKIO_GDS_THRESHOLD",
             "KVIKIO_BOUNCE_BUFFER_SIZE", "KVIKIO_AUTO_DIRECT_IO_READ", "KVIKIO_AUTO_DIRECT_IO_WRITE",
             "KVIKIO_THREAD_POOL_PER_BLOCK_DEVICE", "CUFILE_ENV_PATH_JSON", "CUFILE_LOGGING_LEVEL",
             "CUDA_VISIBLE_DEVICES")


def doctor_report(root: str | None, probe: bool = True) -> dict[str, Any]:
    """Facts about this machine and the pool root(s) (``root`` may list several, ':'-separated).

    ``probe`` runs the engine's cuFile start-up probe in the first root when KvikIO would call
    cuFile there, so the verdict names the path the engine would really settle on.
    """
    report: dict[str, Any] = {
        "python": sys.version.split()[0],
        "native": native.BUILT,
        "torch": _torch_facts(),
        "cupy": _package_facts("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
        "kvikio": _kvikio_facts(),
        "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
        "nvidia_fs": _nvidia_fs_facts(),
        "run_udev_readable": os.path.isdir("/run/udev") and os.access("/run/udev", os.R_OK | os.X_OK),
        "cufile_json": _cufile_json_facts(),
        "compat_io": _compat_io(),
        "arena_bytes": _arena_bytes(),
    }
    report["roots"] = [root_facts(r, report["arena_bytes"]) for r in (root or "").split(":") if r]
    report["probe"] = _probe_facts(report) if probe else {"ran": False, "ok": None, "reason": "not requested"}
    report["warnings"] = _warnings(report)
    report["hints"] = _hints(report)
    report["verdict"] = _verdict(report)
    report["exit_code"] = 1 if any(r["problem"] for r in report["roots"]) else 0
    return report


def format_doctor(report: dict[str, Any]) -> str:
    """The report as aligned text lines for a terminal, verdict last."""
    t, k = report["torch"], report["kvikio"]
    lines = [f"python {report['python']}, torch {t.get('version')}, per-block loops: "
             f"{'C extension' if report['native'] else 'Python (C extension not built)'}"]
    if t.get("cuda_available"):
        lines.append(f"GPU: {t.get('device_name')} ({t.get('device_count')} visible, CUDA {t.get('cuda_version')})")
    else:
        lines.append(f"GPU: none visible to torch{_reason(t.get('error'))}")
    cupy = report["cupy"]
    lines.append(f"cupy: {cupy['version'] if cupy['installed'] else 'not installed'}")
    if k.get("importable"):
        lines.append(f"kvikio {k.get('version')}, libcufile {k.get('libcufile_version')}")
        lines.append(f"  compat_mode={k.get('compat_mode')} (compat preferred: {k.get('compat_mode_preferred')}), "
                     f"num_threads={k.get('num_threads')}, task_size={k.get('task_size')}")
        lines.append(f"  is_gds_available={k.get('is_gds_available')}, allow_compat_mode={k.get('allow_compat_mode')}")
        lines.append(f"  block files without GDS moved by: {report['compat_io']} (TLLM_GDS_KV_COMPAT_IO)")
    else:
        lines.append(f"kvikio: not importable{_reason(k.get('error'))}")
    if k.get("timed_out"):
        lines.append(f"  (KvikIO queries stopped after {CALL_TIMEOUT_S:g} s)")
    nvfs = report["nvidia_fs"]
    lines.append(f"nvidia-fs: {'loaded, ' + str(nvfs.get('version')) if nvfs['present'] else 'not loaded'}")
    lines.append(f"/run/udev readable: {report['run_udev_readable']}")
    cj = report["cufile_json"]
    lines.append(f"cufile.json: {cj['path']} ({'exists' if cj['exists'] else 'missing'}, from {cj['source']})")
    for key, value in sorted(report["env"].items()):
        lines.append(f"env {key}={value}")
    for r in report["roots"]:
        if not r["exists"]:
            lines.append(f"root {r['path']}: {r['problem'] or r['note']}")
            continue
        odirect = {True: "ok", None: "not tried"}.get(r["o_direct_write"], f"failed ({r['o_direct_error']})")
        lines.append(f"root {r['path']}: {r['fs_type']} ({r['mount_source']} on {r['mount_point']}), "
                     f"O_DIRECT 4 KiB write {odirect}, {_gib(r['free_bytes'])} free of {_gib(r['total_bytes'])}")
        if report["arena_bytes"]:
            kind = slab_kind(r["fs_type"] in HOST_FS_TYPES)
            lines.append(f"  slot arena: {_gib(report['arena_bytes'])} per owner, {kind} (TLLM_GDS_KV_ARENA_BYTES)")
        if r["problem"]:
            lines.append(f"  unusable: {r['problem']}")
    p = report["probe"]
    lines.append(f"cuFile probe: {'not run' if not p['ran'] else ('ok' if p['ok'] else 'FAILED')} ({p['reason']})")
    lines.extend(f"warning: {w}" for w in report["warnings"])
    lines.extend(f"hint: {h}" for h in report["hints"])
    lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)


# -- facts ----------------------------------------------------------------------------------------
def _bounded(fn: Callable[[], Any], timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """Run ``fn`` on a daemon thread; raise TimeoutError if it has not returned in time."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    worker = threading.Thread(target=run, name="gdskv-doctor", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _torch_facts() -> dict[str, Any]:
    if not any(map(os.path.exists, NVIDIA_DRIVER_PATHS)):
        return {"version": _package_facts("torch", ("torch",))["version"], "cuda_version": None,
                "cuda_available": False, "error": "no NVIDIA driver is loaded"}
    import torch

    facts: dict[str, Any] = {"version": torch.__version__, "cuda_version": torch.version.cuda,
                             "cuda_available": False}

    def query() -> None:
        if torch.cuda.is_available():
            facts["device_count"] = torch.cuda.device_count()
            facts["device_name"] = torch.cuda.get_device_name(0)
            facts["cuda_available"] = True

    try:
        _bounded(query)
    except Exception as exc:  # noqa: BLE001 - reported
        facts["error"] = _describe(exc)
    return facts


def _package_facts(module: str, distributions: tuple[str, ...]) -> dict[str, Any]:
    """Installed or not, without importing (importing CuPy costs seconds and touches CUDA)."""
    if importlib.util.find_spec(module) is None:
        return {"installed": False, "version": None}
    for dist in distributions:
        try:
            return {"installed": True, "version": importlib.metadata.version(dist)}
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"installed": True, "version": "unknown"}


def _kvikio_facts() -> dict[str, Any]:
    """Filled field by field on a bounded thread, so a hang keeps whatever was learnt before it."""
    facts: dict[str, Any] = {"importable": False}

    def gather() -> None:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults

        facts["importable"] = True
        facts["version"] = kvikio.__version__
        queries: dict[str, Callable[[], Any]] = {
            "libcufile_version": lambda: ".".join(map(str, kvikio.cufile_driver.libcufile_version())),
            "compat_mode": lambda: _enum_name(kvikio.defaults.get("compat_mode")),
            "compat_mode_preferred": kvikio.defaults.is_compat_mode_preferred,
            "num_threads": lambda: kvikio.defaults.get("num_threads"),
            "task_size": lambda: kvikio.defaults.get("task_size"),
            "gds_threshold": lambda: kvikio.defaults.get("gds_threshold"),
            "bounce_buffer_size": lambda: kvikio.defaults.get("bounce_buffer_size"),
            "auto_direct_io_read": lambda: kvikio.defaults.get("auto_direct_io_read"),
            "auto_direct_io_write": lambda: kvikio.defaults.get("auto_direct_io_write"),
            # Driver properties come from cuFileDriverGetProperties, which needs no driver_open.
            "is_gds_available": lambda: bool(kvikio.cufile_driver.get("is_gds_available")),
            "allow_compat_mode": lambda: bool(kvikio.cufile_driver.get("allow_compat_mode")),
        }
        for name, query in queries.items():
            try:
                facts[name] = query()
            except Exception as exc:  # noqa: BLE001 - one unreadable property must not hide the rest
                facts[name] = None
                facts.setdefault("errors", {})[name] = _describe(exc)

    try:
        _bounded(gather)
    except TimeoutError as exc:
        facts["timed_out"] = True
        facts["error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - not importable is a finding
        facts["error"] = _describe(exc)
    return dict(facts)


def _nvidia_fs_facts() -> dict[str, Any]:
    present = os.path.isdir("/proc/driver/nvidia-fs")
    version = None
    if present:
        try:
            with open("/proc/driver/nvidia-fs/version") as f:
                version = f.read().strip()
        except OSError as exc:
            version = f"unreadable ({exc.strerror})"
    return {"present": present, "version": version}


def _cufile_json_facts() -> dict[str, Any]:
    env = os.environ.get("CUFILE_ENV_PATH_JSON")
    path = env or "/etc/cufile.json"
    return {"path": path, "exists": os.path.isfile(path), "source": "CUFILE_ENV_PATH_JSON" if env else "default"}


def root_facts(root: str, arena_bytes: int = 0) -> dict[str, Any]:
    """What a pool root is and whether an owner could serve from it: ``exists`` (a directory, whose
    filesystem facts follow), ``problem`` (one line, or None: usable) and ``note`` (a root the
    connector would create).  A root must be a directory this process can create files in, found by
    creating one (permissions, a read-only mount, an immutable directory and a server's squashing
    all show there, and nowhere else for sure), with room for ``arena_bytes`` of slabs; a missing
    one must be creatable (its nearest existing parent must be such a directory)."""
    facts: dict[str, Any] = {"path": root, "exists": False, "problem": None, "note": ""}
    try:
        st = os.stat(root)
    except FileNotFoundError:
        parent = _nearest_existing(root)
        why = _cannot_create_in(parent)
        facts["note"] = f"does not exist; the connector creates it in {parent}"
        if why:
            facts["problem"] = f"does not exist, and cannot be created in {parent} ({why})"
        return facts
    except OSError as exc:
        facts["problem"] = f"cannot be looked at ({exc.strerror})"
        return facts
    if not stat.S_ISDIR(st.st_mode):
        facts["problem"] = f"is a {file_kind(st.st_mode)}, not a directory"
        return facts
    facts["exists"] = True
    facts.update(mount_of(root))
    vfs = os.statvfs(root)
    facts["free_bytes"] = vfs.f_bavail * vfs.f_frsize
    facts["total_bytes"] = vfs.f_blocks * vfs.f_frsize
    why = _cannot_create_in(root)
    facts["o_direct_write"], facts["o_direct_error"] = (None, "") if why else _o_direct_write(root)
    if why:
        facts["problem"] = f"does not let this process create files ({why})"
    elif arena_bytes > facts["free_bytes"]:
        facts["problem"] = (f"the slot arena (TLLM_GDS_KV_ARENA_BYTES, {_gib(arena_bytes)} per owner) does not fit "
                            f"in its {_gib(facts['free_bytes'])} free")
    return facts


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _cannot_create_in(directory: str) -> str:
    """Why this process cannot create a file in ``directory`` ('' if it can): tried, then removed."""
    path = os.path.join(directory, f".gdskv-check-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        return exc.strerror or str(exc)
    os.unlink(path)
    return ""


def _o_direct_write(root: str) -> tuple[bool, str]:
    """Can KvikIO's POSIX path (and cuFile's compat path) write here with O_DIRECT?  An anonymous
    mapping is page-aligned, which O_DIRECT requires of the buffer."""
    path = os.path.join(root, f".gdskv-doctor-{os.getpid()}-{secrets.token_hex(4)}")
    buf = mmap.mmap(-1, 4096)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o600)
        except OSError as exc:
            return False, f"open with O_DIRECT: {exc.strerror}"
        try:
            written = os.pwrite(fd, buf, 0)
            return (True, "") if written == 4096 else (False, f"wrote {written} of 4096 bytes")
        except OSError as exc:
            return False, f"aligned 4 KiB write: {exc.strerror}"
        finally:
            os.close(fd)
            os.unlink(path)
    finally:
        buf.close()


def _probe_facts(report: dict[str, Any]) -> dict[str, Any]:
    k = report["kvikio"]
    if not report["torch"]["cuda_available"]:
        return {"ran": False, "ok": None, "reason": "no CUDA device"}
    if not k.get("importable"):
        return {"ran": False, "ok": None, "reason": "KvikIO is not importable"}
    if k.get("compat_mode_preferred") is not False:
        return {"ran": False, "ok": None, "reason": "KvikIO prefers its compat mode, so it never calls cuFile"}
    roots = [r for r in report["roots"] if r["exists"] and not r["problem"]]
    if not roots:
        return {"ran": False, "ok": None, "reason": "no usable root given"}
    from gds_kv_connector.engines.kvikio_engine import probe_cufile

    try:
        ok, reason = probe_cufile(roots[0]["path"])
    except Exception as exc:  # noqa: BLE001 - reported
        ok, reason = False, _describe(exc)
    return {"ran": True, "ok": ok, "reason": reason}


# -- conclusions ----------------------------------------------------------------------------------
def _warnings(report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    k = report["kvikio"]
    if not report["native"]:
        out.append("the C extension (csrc/native.c) is not built: keys and arena headers are handled in Python, "
                   "slower per block; reinstall with a C compiler and OpenSSL headers present")
    if report["torch"]["cuda_available"] and k.get("importable") and not report["cupy"]["installed"]:
        out.append("CuPy is not installed: GPU payload checksums (csrc/checksum.cu) cannot be compiled")
    for r in report["roots"]:
        if not r["exists"] or r["problem"]:  # said on its own line
            continue
        if not r["o_direct_write"]:
            out.append(f"root {r['path']}: O_DIRECT is unavailable ({r['o_direct_error']}); "
                       "transfers go through the page cache")
        if k.get("importable") and r["fs_type"] not in GDS_FILESYSTEMS:
            out.append(f"root {r['path']} is {r['fs_type']}, which GDS does not serve: "
                       "cuFile would fall back to its compat mode there")
    if k.get("is_gds_available") and k.get("allow_compat_mode"):
        out.append("allow_compat_mode is true: cuFile may silently bounce I/O through host memory; "
                   'set "allow_compat_mode": false in cufile.json for a strict GDS run')
    return out


def _hints(report: dict[str, Any]) -> list[str]:
    """What would run faster here: not wrong, so not a warning."""
    out: list[str] = []
    if report["arena_bytes"]:
        return out
    for r in report["roots"]:
        if not r["exists"] or r["problem"]:
            continue
        if r["fs_type"] in HOST_FS_TYPES:
            out.append(f"root {r['path']} is in host memory and runs without the slot arena: each block file is "
                       "mapped and registered for DMA on its own, an order of magnitude slower than copies into "
                       "the arena's slabs, which are registered once; set TLLM_GDS_KV_ARENA_BYTES on every owner of the pool")
        else:
            out.append(f"root {r['path']} is a disk without the slot arena: one file per block, so blocks below a "
                       "few MiB save at about half the disk's write rate, where the arena's slots come near it; set TLLM_GDS_KV_ARENA_BYTES on every owner of the pool")
    return out


def _compat_io() -> str:
    """TLLM_GDS_KV_COMPAT_IO as the worker will read it, or why it would refuse to start."""
    try:
        return Settings.load_from(require_root=False).compat_io
    except SettingsError as exc:
        return f"invalid ({exc})"


def _arena_bytes() -> int:
    """TLLM_GDS_KV_ARENA_BYTES as the worker will read it (0 when unset or invalid: settings says why)."""
    try:
        return Settings.load_from(require_root=False).arena_bytes
    except SettingsError:
        return 0


def _verdict(report: dict[str, Any]) -> str:
    t, k, p = report["torch"], report["kvikio"], report["probe"]
    if not t["cuda_available"]:
        return "posix (no CUDA device is visible: the KV pool is in host memory and the POSIX engine moves it)"
    if not k.get("importable"):
        return (f"none for a CUDA pool (KvikIO is not importable{_reason(k.get('error'))}; "
                "install kvikio-cu12 or kvikio-cu13)")
    if k.get("timed_out"):
        return "unknown (KvikIO queries did not return; start the engine with KVIKIO_COMPAT_MODE=ON)"
    posix = "kvikio-posix" if report["compat_io"] == "kvikio" else "staged-direct"  # who moves files without GDS
    if k.get("compat_mode_preferred"):
        if k.get("compat_mode") == "ON":
            return f"{posix} (KVIKIO_COMPAT_MODE=ON)"
        why = ("/run/udev is unreadable" if not report["run_udev_readable"]
               else "libcufile is not loadable or this is WSL")
        return f"{posix} (KVIKIO_COMPAT_MODE=AUTO chose KvikIO's POSIX path: {why})"
    if p["ran"] and not p["ok"]:
        return f"{posix} (fallback: {p['reason']})"
    probed = f"; {p['reason']}" if p["ran"] else "; cuFile not probed (give --root to probe it)"
    if not k.get("is_gds_available"):
        return f"cufile-compat (libcufile is used but nvidia-fs is not loaded{probed})"
    odd = [r["path"] for r in report["roots"] if r["exists"] and r["fs_type"] not in GDS_FILESYSTEMS]
    if odd:
        return f"cufile-compat (nvidia-fs is loaded, but {', '.join(odd)} is not on a GDS filesystem{probed})"
    return f"gds (nvidia-fs is loaded{probed})"


def _enum_name(value: Any) -> str:
    return getattr(value, "name", None) or str(value).rsplit(".", 1)[-1]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _reason(error: str | None) -> str:
    return f" ({error})" if error else ""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
