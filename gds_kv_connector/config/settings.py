"""Connector settings: one table, one name per setting, validated once at start-up.

Settings must reach MPI-spawned TensorRT-LLM workers, and only environment variables named
``TLLM*`` / ``TRTLLM*`` survive that hop, so every setting is an environment variable
``TLLM_GDS_KV_<NAME>``.  ``TLLM_GDS_KV_CONFIG`` may name a JSON or TOML file holding the same
settings by lower-case name; environment variables win over the file.  Anything malformed, out of
its range or at odds with another setting fails at construction with one line naming the setting
and what it allows, never mid-serving.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Mapping

ENV_PREFIX = "TLLM_GDS_KV_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
# A settings file is a few hundred bytes; a larger one is not one (/dev/zero, a log named by mistake).
MAX_CONFIG_BYTES = 1 << 20


class SettingsError(ValueError):
    """A setting is missing, malformed or out of range."""


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


# Numbers are ASCII digits only: int() and float() also take other scripts' digits, "1_000" and
# "nan", and str.isdigit() takes superscripts that int() then refuses.  At most 30 integer digits
# (far past any bound) keeps int() below its digit limit, whose error would not name the setting.
_INT = re.compile(r"[+-]?[0-9]{1,30}")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_SIZE = re.compile(r"(?P<num>[0-9]{1,30}(?:\.[0-9]*)?|\.[0-9]+)(?P<exp>e[+-]?[0-9]+)?(?P<suffix>[a-z]*)")


def _parse_int(text: str) -> int:
    if not _INT.fullmatch(text.strip()):
        raise ValueError(f"expected a whole number such as 8, got {text!r}")
    return int(text)


def _parse_float(text: str) -> float:
    if not _FLOAT.fullmatch(text.strip()):
        raise ValueError(f"expected a number such as 2.5, got {text!r}")
    return float(text)


_SIZE_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
                "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "p": 1 << 50, "pib": 1 << 50,
                "e": 1 << 60, "eib": 1 << 60}


def parse_size(text: str) -> int:
    """Byte count with an optional binary suffix: ``4096``, ``256KiB``, ``4M``, ``2GiB``, ``1.5G``."""
    match = _SIZE.fullmatch(str(text).strip().lower().replace(" ", ""))
    if match is None or match["suffix"] not in _SIZE_SUFFIX:
        raise ValueError(f"expected a byte size such as 4MiB, got {text!r}")
    unit = _SIZE_SUFFIX[match["suffix"]]
    if match["exp"] is None and "." not in match["num"]:
        return int(match["num"]) * unit  # exact: a float would round a count past 2**53
    value = float(match["num"] + (match["exp"] or "")) * unit
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"expected a whole number of bytes, got {text!r}")
    return int(value)


def format_size(n: int) -> str:
    """``n`` bytes with the largest binary suffix that divides it: ``4MiB``, ``1EiB``, ``4097``."""
    for suffix in ("EiB", "PiB", "TiB", "GiB", "MiB", "KiB"):
        unit = _SIZE_SUFFIX[suffix.lower()]
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


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
# An exbibyte: more than any filesystem holds, and a sum of a few such counts still fits the signed
# 64-bit counters of the stats.
MAX_BYTES = 1 << 60


def _between(low: float, high: float, show: Callable[[float], str] = "{:g}".format,
             zero: str = "") -> Callable[[Any], str | None]:
    """``low <= v <= high``, or 0 too where ``zero`` says what 0 means (off).  NaN and the
    infinities fail it: inf broke eviction (int(inf * 1e9)) and the stats thread (a wait past
    TIMEOUT_MAX) while serving."""
    allowed = f"{show(low)}..{show(high)}"
    if zero:
        allowed = f"0 ({zero}) or {allowed}"
    return lambda v: None if (zero and v == 0) or low <= v <= high else f"must be {allowed}"


def _seconds(low: float, zero: str = "") -> Callable[[Any], str | None]:
    return _between(low, MAX_SECONDS, lambda x: f"{x:g}s", zero)


def _bytes(low: int) -> Callable[[Any], str | None]:
    return _between(low, MAX_BYTES, lambda x: format_size(int(x)))


# Durations below these are mistakes that cost the process, not tunings (each spec's use says why).
MIN_DEADLINE_S = 0.1  # one batch's I/O takes milliseconds: less drops every save and fails every load
MIN_CONTROL_GRACE_S = 0.01  # about one write on a busy disk: less takes an ordinary write for a hung one
MIN_STATS_INTERVAL_S = 0.1  # each refresh rewrites a file in every root: more often spends a core on it
MIN_EVICT_TIME_LIMIT_S = 1.0  # starting an interpreter takes a good part of a second: less kills every run
# Each slab is a file, held open and, on a host-memory pool, mapped and registered: below a
# mebibyte an arena of gigabytes is thousands of them.
MIN_SLAB_BYTES = 1 << 20


def _one_of(*choices: str) -> Callable[[str], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _fraction(v: float) -> str | None:
    return None if 0.0 < v < 1.0 else "must be between 0 and 1 (exclusive)"


MAX_SEEN = 1_000_000  # far past the matches of any prefix an owner remembers


def _admission(v: str) -> str | None:
    if v in ("all", "prompt"):
        return None
    count = re.fullmatch(r"seen:([0-9]{1,7})", v)
    if count and 1 <= int(count[1]) <= MAX_SEEN:
        return None
    return f"must be all, prompt, or seen:N with N 1..{MAX_SEEN}"


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
    SettingSpec("io_threads", 16, _parse_int, "Threads moving bytes: the POSIX engine's and the staged path's "
                "reads and writes each have this many (a load never queues behind writes), KvikIO's "
                "KVIKIO_NTHREADS (one FIFO: a batch keeps at most twice this many transfers in it).",
                _between(1, 256)),
    SettingSpec("transfer_threads", 4, _parse_int, "Threads driving transfer batches (event wait, checksum, "
                "publish).", _between(1, 64)),
    SettingSpec("stage_ahead", 4, _parse_int, "Save batches that may go on writing from their host stage while as "
                "many further batches as TLLM_GDS_KV_TRANSFER_THREADS are taken, so saves queued behind slow "
                "storage are copied off their pages at PCIe speed and their requests reported (the staged "
                "path only: where GDS or KvikIO writes from the pages, they stay held to the write's end). "
                "There are TLLM_GDS_KV_TRANSFER_THREADS plus this many transfer threads, each with its own "
                "stage of 72MiB of pinned host memory once it has staged a batch (kept while the process "
                "runs); 0 takes no batch beyond TLLM_GDS_KV_TRANSFER_THREADS.",
                _between(0, 64)),
    SettingSpec("async_load_bytes", 4 << 20, parse_size, "Loads larger than this many bytes are asynchronous "
                "(the request is parked); smaller ones complete before the first layer runs.", _bytes(0)),
    SettingSpec("deadline_s", 60.0, _parse_float, "Connector-side deadline for one transfer batch. A load must "
                "complete within it from acceptance, or the process fails. A save that has not started "
                "within it is dropped (counted); one still writing this long after it started stops between "
                "blocks (the rest dropped, counted), and fails the process only if the write in flight then "
                "has not returned TLLM_GDS_KV_CONTROL_GRACE_S later while its finished request waits (its "
                "pages cannot be freed before the write ends). A save can thus end up to twice this plus the "
                "grace after it was accepted: keep that under TensorRT-LLM's transfer timeout (checked at "
                "start-up where TensorRT-LLM exposes it).", _seconds(MIN_DEADLINE_S)),
    SettingSpec("max_queued_save_bytes", 4 << 30, parse_size, "Bytes of saves accepted and not yet done "
                "(queued or being written) per worker; saves beyond it are dropped (counted), never queued. "
                "It bounds the KV pages finished requests hold while their saves wait, and how long a save "
                "waits for storage slower than the KV produced: 4GiB is a few percent of a large GPU's KV "
                "cache and about a second of writes to one NVMe drive. 0 means unbounded.", _bytes(0)),
    SettingSpec("control_grace_s", 1.0, _parse_float, "How long cancellation and shutdown wait for in-flight I/O to "
                "drain; request_reset waits up to the transfer's deadline and warns once it passes this.",
                _seconds(MIN_CONTROL_GRACE_S)),
    SettingSpec("read_retries", 2, _parse_int, "Retries of a transient read error (EIO, EAGAIN, EINTR, ETIMEDOUT) "
                "within the deadline, after a pause of 10 ms doubled for each further one.",
                _between(0, 20)),
    SettingSpec("fsync", False, _parse_bool, "fsync a block before publishing it (survives power loss; "
                "slower)."),
    SettingSpec("save", True, _parse_bool, "Save full blocks to the pool."),
    SettingSpec("load", True, _parse_bool, "Load matched blocks from the pool."),
    SettingSpec("load_policy", "always", str, "Whether a matched prefix is loaded or computed: always (every "
                "match is loaded), latency (loaded only when its load is expected to end before its compute "
                "would: the request's time to first token), or throughput (GPU time only: an asynchronous "
                "load parks its request while the GPU serves others, so it is loaded whenever it is expected "
                "to end; a synchronous one holds the batch's forward, and follows the latency rule). Load "
                "time is the bytes queued and matched over the rate this worker's loads measured; compute "
                "time is fitted to the prompt forwards it timed (tokens and attention context). Until a "
                "load has been measured, and after 60 s without one, a match is loaded (and measured). "
                "Neither latency nor throughput loads what is expected to take over half of "
                "TLLM_GDS_KV_DEADLINE_S. docs/ttft.md has the rules and the bench that checks them.",
                _one_of("always", "latency", "throughput")),
    SettingSpec("verify", True, _parse_bool, "Verify the payload checksum of every loaded block."),
    SettingSpec("index_ttl_s", 5.0, _parse_float, "How long a positive lookup is trusted before the file is "
                "checked again.", _seconds(0)),
    SettingSpec("share_group", False, _parse_bool, "Create pool files group-readable and directories "
                "group-writable (setgid) so owners running as different users of one group share a pool."),
    SettingSpec("quota_bytes", 0, parse_size, "Byte budget per root; 0 means unbounded.", _bytes(0)),
    SettingSpec("min_free_bytes", 0, parse_size, "Evict when the root's filesystem has less free space "
                "than this; 0 disables.", _bytes(0)),
    SettingSpec("low_watermark", 0.9, _parse_float, "Eviction stops at this fraction of the quota.", _fraction),
    SettingSpec("evict_grace_s", 300.0, _parse_float, "Blocks accessed more recently than this are never "
                "evicted (protects promised and in-flight loads).", _seconds(0)),
    SettingSpec("evict_runner", "process", str, "Where this owner's eviction runs (with a quota or a free-space "
                "floor): process (a fresh interpreter per run, started by the evictor thread, which waits for it "
                "without holding the GIL: a run over a large pool takes no GIL time from the executor thread; a "
                "child that fails or passes TLLM_GDS_KV_EVICT_TIME_LIMIT_S only fails that run, saves go on) or "
                "thread (in the serving process, competing with the executor thread for the GIL: for hosts "
                "where starting processes is not allowed).", _one_of("process", "thread")),
    SettingSpec("evict_time_limit_s", 3600.0, _parse_float, "How long an eviction run in a child process "
                "(TLLM_GDS_KV_EVICT_RUNNER=process) may take before it is killed (its locks die with it) and "
                "counted as failed; the next run comes at the next check. Raise it for a pool whose runs take "
                "longer.", _seconds(MIN_EVICT_TIME_LIMIT_S)),
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
                "no file created per block. Every owner of such a pool must set it.", _bytes(0)),
    SettingSpec("arena_slab_bytes", 256 << 20, parse_size, "Size of one arena slab file (the unit other "
                "owners map and register when they read from it, on a host-memory pool).", _bytes(MIN_SLAB_BYTES)),
    SettingSpec("arena_on_shared_fs", False, _parse_bool, "Run the slot arena on a network or FUSE filesystem "
                "(NFS, GlusterFS, Lustre, GPFS, ...). Off: the arena is refused there at start-up, since another "
                "node's client would read slots that changed through its own page cache and fail promised loads. "
                "Set it only where clients keep no data cache (GlusterFS direct-io-mode=enable; see "
                "docs/deployment.md)."),
    SettingSpec("arena_reuse_delay_s", 5.0, _parse_float, "How long an arena slot whose reference was removed "
                "stays untouched before it is overwritten (covers readers that resolved it just before).",
                _seconds(0)),
    SettingSpec("stats_interval_s", 10.0, _parse_float, "How often each owner refreshes its stats file in the "
                "pool; 0 disables.", _seconds(MIN_STATS_INTERVAL_S, zero="off")),
    SettingSpec("trace", "nvtx", str, "Where the connector's timeline ranges (gdskv/...) go: nvtx (Nsight "
                "Systems; entered only while an NVTX tool is attached, free otherwise) or torch "
                "(torch.profiler record_function, so a Chrome/Perfetto trace taken without Nsight shows "
                "them; each callback then asks whether a profiler runs, about 0.3 us, so for profiling "
                "runs). Read when the package is imported.", _one_of("nvtx", "torch")),
)

_BY_NAME = {s.name: s for s in SPECS}
_BY_ENV_SUFFIX = {s.env[len(ENV_PREFIX):] for s in SPECS}
_ENV_NAMES = [CONFIG_ENV, *(s.env for s in SPECS)]


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
    load_policy: str
    verify: bool
    index_ttl_s: float
    share_group: bool
    quota_bytes: int
    min_free_bytes: int
    low_watermark: float
    evict_grace_s: float
    evict_runner: str
    evict_time_limit_s: float
    admission: str
    save_generated: str
    arena_bytes: int
    arena_slab_bytes: int
    arena_on_shared_fs: bool
    arena_reuse_delay_s: float
    stats_interval_s: float
    trace: str

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(r for r in self.root.split(":") if r)

    @classmethod
    def load_from(cls, env: Mapping[str, str] | None = None, require_root: bool = True,
                  **overrides: Any) -> "Settings":
        """Resolve every setting: overrides > environment > config file > default.  ``require_root``:
        the settings are for serving (the connector, ``gds-kv settings --check``), so a root is
        required and an arena must fit its filesystem; the ops commands, which look at or clean a
        pool whatever its state, pass False."""
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
            raise SettingsError(f"unknown setting(s): {_with_hints(unknown, _BY_NAME)}")
        stray = [k for k in env if k.startswith(ENV_PREFIX) and k != CONFIG_ENV
                 and k[len(ENV_PREFIX):] not in _BY_ENV_SUFFIX]  # exact: a lower-case name is never read
        if stray:
            raise SettingsError(f"unknown environment variable(s): {_with_hints(stray, _ENV_NAMES, ENV_PREFIX)}; "
                                "`gds-kv settings` lists them all")
        settings = cls(**values)
        if require_root and not settings.roots:
            raise SettingsError(f"{ENV_PREFIX}ROOT is not set: name the pool directory "
                                "(e.g. export TLLM_GDS_KV_ROOT=/mnt/nvme/kv-pool)")
        if settings.arena_bytes and len(settings.roots) > 1:
            raise SettingsError(f"{ENV_PREFIX}ARENA_BYTES serves one pool root, but {ENV_PREFIX}ROOT names "
                                f"{len(settings.roots)}")
        _check_grace_covers_index(settings)
        if require_root and settings.arena_bytes:
            _check_arena_room(settings.arena_bytes, settings.roots[0])
        return settings


def _with_hints(names: Iterable[str], known: Iterable[str], prefix: str = "") -> str:
    """``names``, each with the known name it most resembles (case and ``prefix`` aside): one short
    line, where the list of every setting was several hundred characters."""
    known = list(known)
    return ", ".join(name + did_you_mean(name, known, prefix) for name in sorted(names))


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean X?)`` with the known name ``name`` most resembles (case and ``prefix``
    aside), or '' where none is close: a near miss (a setting, a command, an option) named in the
    one line that refuses it."""
    by_key = {k[len(prefix):].lower(): k for k in known}
    close = difflib.get_close_matches(name[len(prefix):].lower(), by_key, n=1)
    return f" (did you mean {by_key[close[0]]}?)" if close else ""


def _check_grace_covers_index(settings: "Settings") -> None:
    """Where this owner evicts (a quota or a free-space floor), ``evict_grace_s >= index_ttl_s``.
    The owner trusts a block it published or promised for ``index_ttl_s`` after that, promising it
    again from its index without looking at the file, while eviction spares a block for only
    ``evict_grace_s`` after its publication or last promise: a shorter grace lets the evictor remove
    blocks the index still promises, whose loads then fail."""
    evicts = settings.quota_bytes or settings.min_free_bytes
    if evicts and settings.evict_grace_s < settings.index_ttl_s:
        raise SettingsError(f"{ENV_PREFIX}EVICT_GRACE_S={settings.evict_grace_s:g} is below {ENV_PREFIX}INDEX_TTL_S="
                            f"{settings.index_ttl_s:g}: eviction (QUOTA_BYTES or MIN_FREE_BYTES is set) would remove "
                            "blocks this owner still promises from its index; EVICT_GRACE_S must be >= INDEX_TTL_S")


def _check_arena_room(arena_bytes: int, root: str) -> None:
    """Refuse an arena its filesystem cannot hold: the slabs would stop short, and every save past
    them fail for as long as the process runs."""
    room = _arena_room(root)
    if room is not None and arena_bytes > room:
        raise SettingsError(f"{ENV_PREFIX}ARENA_BYTES={format_size(arena_bytes)} does not fit in {root!r}: "
                            f"{arena_bytes} bytes wanted, {room} free (this host's slabs already there counted as "
                            "free); must be at most that")


def _arena_room(root: str) -> int | None:
    """Free bytes of the filesystem ``root`` is on (of its nearest existing parent, before the pool
    is made), plus the bytes of this host's slabs already in the pool, which a restarted owner
    adopts instead of creating: an upper bound, so that a restart is never refused (a co-tenant's
    slabs counted here are not free to this owner).  None where the filesystem reports no size
    (some FUSE and network mounts say 0 blocks): its free count says nothing."""
    from gds_kv_connector.format.layout import LAYOUT_DIR, SLABS_DIR, slab_host_is_this, slab_of_tmp_name

    path = os.path.abspath(root)
    while not os.path.isdir(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    fs = os.statvfs(path)
    if fs.f_blocks == 0:
        return None
    slabs = 0
    for fp_dir in _entries(os.path.join(root, LAYOUT_DIR)):
        for slab in _entries(os.path.join(fp_dir.path, SLABS_DIR)):
            if slab_host_is_this(slab_of_tmp_name(slab.name) or slab.name):
                slabs += _size(slab)
    return fs.f_bavail * fs.f_frsize + slabs


def _entries(directory: str) -> list[os.DirEntry]:
    """``directory``'s entries; none where it is missing or unreadable (a pool not yet made)."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:
        return []


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0


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
            value = _to_float(raw) if isinstance(spec.default, float) else raw
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"{source}: {exc}") from None
    problem = spec.check(value)
    if problem:
        raise SettingsError(f"{source}={raw!r}: {problem}")
    return value


def _to_float(n: int | float) -> float:
    """``n`` as a float; an integer past a float's range is past every bound, so it becomes an
    infinity, which the range check then names the bounds for (float() would raise OverflowError)."""
    try:
        return float(n)
    except OverflowError:
        return math.inf if n > 0 else -math.inf


def _read_config_file(path: str) -> dict[str, Any]:
    if not path:
        return {}
    data = _read_config_bytes(path)
    kind = "TOML" if path.endswith(".toml") else "JSON"
    try:
        parsed = tomllib.loads(data.decode()) if kind == "TOML" else json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, TOMLDecodeError are ValueErrors
        raise SettingsError(f"{CONFIG_ENV}={path!r}: not valid {kind} ({exc})") from None
    except RecursionError:
        raise SettingsError(f"{CONFIG_ENV}={path!r}: not valid {kind} (nested too deeply)") from None
    if not isinstance(parsed, dict):
        raise SettingsError(f"{CONFIG_ENV}={path!r}: expected a table of settings")
    unknown = set(parsed) - set(_BY_NAME)
    if unknown:
        raise SettingsError(f"{CONFIG_ENV}={path!r}: unknown setting(s) {_with_hints(unknown, _BY_NAME)}")
    return parsed


def _read_config_bytes(path: str) -> bytes:
    """The file's bytes, read so that no file named by mistake can hang start-up or fill memory:
    O_NONBLOCK, since open(2) of a FIFO waits for a writer for ever; a regular file only, since a
    device (/dev/zero) or a FIFO never ends; at most MAX_CONFIG_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SettingsError(f"{CONFIG_ENV}={path!r}: cannot read ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SettingsError(f"{CONFIG_ENV}={path!r}: not a regular file")
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise SettingsError(f"{CONFIG_ENV}={path!r}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise SettingsError(f"{CONFIG_ENV}={path!r}: larger than {format_size(MAX_CONFIG_BYTES)}, not a settings file")
    return b"".join(chunks)


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
