"""Connector settings: one table, one name per setting, validated once at start-up.

Settings must reach MPI-spawned TensorRT-LLM workers, and only environment variables named
``TLLM*`` / ``TRTLLM*`` survive that hop, so every setting is an environment variable
``TLLM_GDS_KV_<NAME>``.  ``TLLM_GDS_KV_CONFIG`` may name a JSON or TOML file holding the same
settings by lower-case name; environment variables win over the file.  Anything malformed fails
at construction with one line naming the setting, never mid-serving.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

ENV_PREFIX = "TLLM_GDS_KV_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range."""


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


_SIZE_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
                "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Byte count with an optional binary suffix: ``4096``, ``256KiB``, ``4M``, ``2GiB``."""
    raw = str(text).strip().lower().replace(" ", "")
    num = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = raw[len(num):]
    if suffix not in _SIZE_SUFFIX or not num:
        raise ValueError(f"expected a byte size such as 4MiB, got {text!r}")
    value = float(num) * _SIZE_SUFFIX[suffix]
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise ValueError(f"expected a non-negative whole number of bytes, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class SettingSpec:
    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str
    check: Callable[[Any], str | None] = lambda v: None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


MAX_SECONDS = 1e9  # about 31 years: any longer duration is a mistake, and waits overflow past it


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _one_of(*choices: str) -> Callable[[str], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _fraction(v: float) -> str | None:
    return None if 0.0 < v < 1.0 else "must be between 0 and 1 (exclusive)"


def _admission(v: str) -> str | None:
    if v in ("all", "prompt"):
        return None
    if v.startswith("seen:") and v[5:].isdigit() and int(v[5:]) >= 1:
        return None
    return "must be all, prompt, or seen:N with N >= 1"


SPECS: tuple[SettingSpec, ...] = (
    SettingSpec("root", "", str, "Pool directory shared by every owner (required by the connector). "
                "Several roots may be given separated by ':'; a block's root is chosen by its key."),
    SettingSpec("model_id", "", str, "Model identity mixed into the pool fingerprint. Empty: taken from "
                "llm_args.model, with @ and llm_args.revision when one is set. Set it when the same weights "
                "are served under different paths; it replaces both (name the revision in it yourself)."),
    SettingSpec("engine", "auto", str, "I/O engine: auto (kvikio for a CUDA pool, posix for a host pool), "
                "posix, or kvikio.", _one_of("auto", "posix", "kvikio")),
    SettingSpec("compat_io", "staged", str, "Who moves block files of a CUDA pool when GPUDirect Storage is "
                "not in use (KvikIO would take its POSIX path): staged (one coalesced DMA per batch into "
                "registered host staging, then one O_DIRECT read or write per file on the I/O threads) or "
                "kvikio (KvikIO's POSIX path, a CuFile and bounce buffer per file).",
                _one_of("staged", "kvikio")),
    SettingSpec("io_threads", 16, int, "Threads moving bytes: the POSIX engine's and the staged path's "
                "reads and writes each have this many (a load never queues behind writes), KvikIO's "
                "KVIKIO_NTHREADS (one FIFO: a batch keeps at most twice this many transfers in it).",
                lambda v: None if 1 <= v <= 256 else "must be 1..256"),
    SettingSpec("transfer_threads", 4, int, "Threads driving transfer batches (event wait, checksum, "
                "publish).", lambda v: None if 1 <= v <= 64 else "must be 1..64"),
    SettingSpec("stage_ahead", 4, int, "Save batches that may go on writing from their host stage while as "
                "many further batches as TLLM_GDS_KV_TRANSFER_THREADS are taken, so saves queued behind slow "
                "storage are copied off their pages at PCIe speed and their requests reported (the staged "
                "path only: where GDS or KvikIO writes from the pages, they stay held to the write's end). "
                "There are TLLM_GDS_KV_TRANSFER_THREADS plus this many transfer threads, each with its own "
                "stage of 72MiB of pinned host memory once it has staged a batch (kept while the process "
                "runs); 0 takes no batch beyond TLLM_GDS_KV_TRANSFER_THREADS.",
                lambda v: None if 0 <= v <= 64 else "must be 0..64"),
    SettingSpec("async_load_bytes", 4 << 20, parse_size, "Loads larger than this many bytes are asynchronous "
                "(the request is parked); smaller ones complete before the first layer runs.", _non_negative),
    SettingSpec("deadline_s", 60.0, float, "Connector-side deadline for one transfer batch. A load must "
                "complete within it from acceptance, or the process fails. A save that has not started "
                "within it is dropped (counted); one still writing this long after it started stops between "
                "blocks (the rest dropped, counted), and fails the process only if the write in flight then "
                "has not returned TLLM_GDS_KV_CONTROL_GRACE_S later while its finished request waits (its "
                "pages cannot be freed before the write ends). A save can thus end up to twice this plus the "
                "grace after it was accepted: keep that under TensorRT-LLM's transfer timeout (checked at "
                "start-up where TensorRT-LLM exposes it).", _positive),
    SettingSpec("max_queued_save_bytes", 4 << 30, parse_size, "Bytes of saves accepted and not yet done "
                "(queued or being written) per worker; saves beyond it are dropped (counted), never queued. "
                "It bounds the KV pages finished requests hold while their saves wait, and how long a save "
                "waits for storage slower than the KV produced: 4GiB is a few percent of a large GPU's KV "
                "cache and about a second of writes to one NVMe drive. 0 means unbounded.", _non_negative),
    SettingSpec("control_grace_s", 1.0, float, "How long cancellation and shutdown wait for in-flight I/O to "
                "drain; request_reset waits up to the transfer's deadline and warns once it passes this.",
                _positive),
    SettingSpec("read_retries", 2, int, "Retries of a transient read error (EIO, EAGAIN, EINTR, ETIMEDOUT) "
                "within the deadline, after a pause of 10 ms doubled for each further one.",
                lambda v: None if 0 <= v <= 20 else "must be 0..20"),
    SettingSpec("fsync", False, _parse_bool, "fsync a block before publishing it (survives power loss; "
                "slower)."),
    SettingSpec("save", True, _parse_bool, "Save full blocks to the pool."),
    SettingSpec("load", True, _parse_bool, "Load matched blocks from the pool."),
    SettingSpec("verify", True, _parse_bool, "Verify the payload checksum of every loaded block."),
    SettingSpec("index_ttl_s", 5.0, float, "How long a positive lookup is trusted before the file is "
                "checked again.", _non_negative),
    SettingSpec("share_group", False, _parse_bool, "Create pool files group-readable and directories "
                "group-writable (setgid) so owners running as different users of one group share a pool."),
    SettingSpec("quota_bytes", 0, parse_size, "Byte budget per root; 0 means unbounded.", _non_negative),
    SettingSpec("min_free_bytes", 0, parse_size, "Evict when the root's filesystem has less free space "
                "than this; 0 disables.", _non_negative),
    SettingSpec("low_watermark", 0.9, float, "Eviction stops at this fraction of the quota.", _fraction),
    SettingSpec("evict_grace_s", 300.0, float, "Blocks accessed more recently than this are never "
                "evicted (protects promised and in-flight loads).", _non_negative),
    SettingSpec("admission", "all", str, "Which full blocks to save: all, prompt (prompt blocks only), "
                "or seen:N (prefixes matched at least N times by this owner).", _admission),
    SettingSpec("save_generated", "auto", str, "When a request's generated (decode) blocks are saved: "
                "finish (all at once when the request finishes: the executor thread does no work per "
                "running request per decode step, and reads the tokens it lacks once at the end), eager "
                "(each as soon as it is full: published sooner, and fewer of the request's pages wait "
                "for saves when it finishes), or auto (finish where "
                "the scheduler hands a finished request's saves straight to its worker, TP 1 or attention "
                "DP; eager under plain TP, where finish is refused: a finished request's saves could reach "
                "the other ranks only after its pages are freed).",
                _one_of("auto", "finish", "eager")),
    SettingSpec("arena_bytes", 0, parse_size, "Bytes of slab files each owner preallocates and keeps blocks "
                "in, instead of one file per block; 0 disables. On a host-memory pool (tmpfs, e.g. "
                "/dev/shm) slabs are mapped and registered for DMA once, so blocks move at the PCIe limit; "
                "on a disk pool slots are written and read with O_DIRECT, adjacent slots in one I/O, with "
                "no file created per block. Every owner of such a pool must set it.", _non_negative),
    SettingSpec("arena_slab_bytes", 256 << 20, parse_size, "Size of one arena slab file (the unit other "
                "owners map and register when they read from it, on a host-memory pool).", _positive),
    SettingSpec("arena_reuse_delay_s", 5.0, float, "How long an arena slot whose reference was removed "
                "stays untouched before it is overwritten (covers readers that resolved it just before).",
                _non_negative),
    SettingSpec("stats_interval_s", 10.0, float, "How often each owner refreshes its stats file in the "
                "pool; 0 disables.", _non_negative),
    SettingSpec("trace", "nvtx", str, "Where the connector's timeline ranges (gdskv/...) go: nvtx (Nsight "
                "Systems; entered only while an NVTX tool is attached, free otherwise) or torch "
                "(torch.profiler record_function, so a Chrome/Perfetto trace taken without Nsight shows "
                "them; each callback then asks whether a profiler runs, about 0.3 us, so for profiling "
                "runs). Read when the package is imported.", _one_of("nvtx", "torch")),
)

_BY_NAME = {s.name: s for s in SPECS}
_BY_ENV_SUFFIX = {s.env[len(ENV_PREFIX):] for s in SPECS}


@dataclass(frozen=True)
class Settings:
    root: str
    model_id: str
    engine: str
    compat_io: str
    io_threads: int
    transfer_threads: int
    stage_ahead: int
    async_load_bytes: int
    deadline_s: float
    max_queued_save_bytes: int
    control_grace_s: float
    read_retries: int
    fsync: bool
    save: bool
    load: bool
    verify: bool
    index_ttl_s: float
    share_group: bool
    quota_bytes: int
    min_free_bytes: int
    low_watermark: float
    evict_grace_s: float
    admission: str
    save_generated: str
    arena_bytes: int
    arena_slab_bytes: int
    arena_reuse_delay_s: float
    stats_interval_s: float
    trace: str

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(r for r in self.root.split(":") if r)

    @classmethod
    def load_from(cls, env: Mapping[str, str] | None = None, require_root: bool = True,
                  **overrides: Any) -> "Settings":
        """Resolve every setting: overrides > environment > config file > default."""
        env = os.environ if env is None else env
        file_values = _read_config_file(env.get(CONFIG_ENV, ""))
        values: dict[str, Any] = {}
        for spec in SPECS:
            if spec.name in overrides and overrides[spec.name] is not None:
                raw, source = overrides[spec.name], "argument"
            elif spec.env in env:
                raw, source = env[spec.env], spec.env
            elif spec.name in file_values:
                raw, source = file_values[spec.name], f"{env.get(CONFIG_ENV)}:{spec.name}"
            else:
                values[spec.name] = spec.default
                continue
            values[spec.name] = _convert(spec, raw, source)
        unknown = set(overrides) - set(_BY_NAME)
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        stray = sorted(k for k in env if k.startswith(ENV_PREFIX) and k != CONFIG_ENV
                       and k[len(ENV_PREFIX):] not in _BY_ENV_SUFFIX)  # exact: a lower-case name is never read
        if stray:
            raise SettingsError(f"unknown environment variable(s): {', '.join(stray)} "
                                f"(known: {', '.join(s.env for s in SPECS)})")
        settings = cls(**values)
        if require_root and not settings.roots:
            raise SettingsError(f"{ENV_PREFIX}ROOT is not set: name the pool directory "
                                "(e.g. export TLLM_GDS_KV_ROOT=/mnt/nvme/kv-pool)")
        if settings.arena_bytes and len(settings.roots) > 1:
            raise SettingsError(f"{ENV_PREFIX}ARENA_BYTES serves one pool root, but {ENV_PREFIX}ROOT names "
                                f"{len(settings.roots)}")
        return settings


def _convert(spec: SettingSpec, raw: Any, source: str) -> Any:
    try:
        if isinstance(raw, str):
            value = spec.parse(raw)
        elif isinstance(spec.default, bool):
            if not isinstance(raw, bool):
                raise ValueError(f"expected a boolean, got {raw!r}")
            value = raw
        else:
            # a config file's value must already be of the setting's type: 16.9 threads, true
            # retries or a null root are mistakes, not values to round or spell out
            want = (int, float) if isinstance(spec.default, float) else type(spec.default)
            if isinstance(raw, bool) or not isinstance(raw, want):
                kind = ("a size (bytes as an integer, or a string such as '4MiB')" if spec.parse is parse_size
                        else type(spec.default).__name__)
                raise ValueError(f"expected {kind}, got {raw!r}")
            value = parse_size(str(raw)) if spec.parse is parse_size else type(spec.default)(raw)
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"{source}: {exc}") from None
    if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_SECONDS):
        # every float setting is a duration or a fraction: inf passed the range checks, then broke
        # eviction (int(inf * 1e9)) and the stats thread (a wait past TIMEOUT_MAX) while serving
        raise SettingsError(f"{source}={raw!r}: must be a finite number of at most {MAX_SECONDS:.0e}")
    problem = spec.check(value)
    if problem:
        raise SettingsError(f"{source}={raw!r}: {problem}")
    return value


def _read_config_file(path: str) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise SettingsError(f"{CONFIG_ENV}={path!r}: cannot read ({exc.strerror})") from None
    try:
        parsed = tomllib.loads(data.decode()) if path.endswith(".toml") else json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{CONFIG_ENV}={path!r}: not valid {'TOML' if path.endswith('.toml') else 'JSON'} "
                            f"({exc})") from None
    if not isinstance(parsed, dict):
        raise SettingsError(f"{CONFIG_ENV}={path!r}: expected a table of settings")
    unknown = sorted(set(parsed) - set(_BY_NAME))
    if unknown:
        raise SettingsError(f"{CONFIG_ENV}={path!r}: unknown setting(s) {', '.join(unknown)}")
    return parsed


def import_time_value(name: str) -> Any:
    """A setting needed when a module is imported, before any :class:`Settings` exists (whether the
    callbacks carry trace ranges is settled by decorating them): environment, then config file, then
    the default.  A malformed value gives the default here and fails at start-up, in
    :meth:`Settings.load_from`, like any other."""
    spec = _BY_NAME[name]
    try:
        if spec.env in os.environ:
            return _convert(spec, os.environ[spec.env], spec.env)
        file_values = _read_config_file(os.environ.get(CONFIG_ENV, ""))
        if name in file_values:
            return _convert(spec, file_values[name], f"{os.environ.get(CONFIG_ENV)}:{name}")
    except SettingsError:
        pass
    return spec.default


def settings_table() -> list[tuple[str, str, str]]:
    """(environment variable, default, meaning) for docs and ``gds-kv settings``."""
    return [(s.env, repr(s.default) if isinstance(s.default, str) else str(s.default), s.doc) for s in SPECS]


assert [f.name for f in fields(Settings)] == [s.name for s in SPECS], "Settings fields drifted from SPECS"
