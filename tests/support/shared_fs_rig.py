"""A real distributed filesystem on one machine, mounted twice as two "nodes" (issue 43).

The rig starts its own GlusterFS management daemon (``glusterd``, with a private working directory
under the rig's directory, so nothing of it outlives the rig), creates a one-brick volume on a
local directory, starts it and FUSE-mounts it twice (``mount -t glusterfs``) at two mount points,
``a`` and ``b``.  Each mount is its own GlusterFS client process with its own caches (kernel dentry
and attribute caches, GlusterFS md-cache, io-cache, write-behind...), talking to the brick over TCP,
so two processes that use different mounts see each other only through the filesystem's protocol,
as two nodes do.  What one machine cannot give: a network between the clients and the server (the
brick is on loopback), and clocks that differ.

A node's owners run as child processes with their own host name: ``unshare --uts`` gives the child
a UTS namespace of its own and the child sets its host name (``socket.sethostname``) before it
imports the package, which reads ``socket.gethostname()`` once at import (the host tag in
temporary-file names, writer marks, slab names, lock holders).  Mounts and pids stay shared: the
children of both nodes live in one pid namespace, which is harmless here because the package
checks pids only for files whose host tag is its own host's.

Run as a script this module is that child (``python shared_fs_rig.py owner SPEC.json``): it
serves conversations through the reference executor (the package's entry points only) and writes
a JSON report.  Nothing here imports the package at module level, so a child sets its host name
first.

Everything the rig starts it stops in :meth:`GlusterRig.stop` (unmount, volume stop and delete,
the daemons it started killed by pid), which the test fixture calls even when a test fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

GLUSTERD_PORT = 24007
RIG_MARK = "gdskv-rig"  # in the name of every directory the rig makes (its daemons' command lines show it)
APT_LINE = ("apt-get install -y --no-install-recommends glusterfs-server glusterfs-client")
HERE = os.path.abspath(__file__)


class RigUnavailable(Exception):
    """This machine cannot run the rig; the message is one line saying why."""


# -- can this machine run it? -------------------------------------------------------------------------
def unavailable() -> str | None:
    """One line saying why the rig cannot run here, or None."""
    if sys.platform != "linux":
        return "shared-FS rig: needs Linux"
    if os.geteuid() != 0:
        return "shared-FS rig: needs root (glusterd, mount -t glusterfs and unshare --uts)"
    if not os.path.exists("/dev/fuse"):
        return "shared-FS rig: /dev/fuse is missing (no FUSE in this container; `modprobe fuse` on the host)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"shared-FS rig: /dev/fuse cannot be opened ({exc.strerror}): the container may not use FUSE"
    missing = [b for b in ("glusterd", "gluster", "glusterfs", "mount.glusterfs", "unshare")
               if shutil.which(b) is None and not os.path.exists(f"/sbin/{b}") and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"shared-FS rig: {', '.join(missing)} not installed (Debian/Ubuntu: {APT_LINE})"
    try:
        subprocess.run(["unshare", "--uts", "true"], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        return f"shared-FS rig: `unshare --uts` fails here ({_first_line(exc)}): no per-node host names"
    with contextlib.closing(socket.socket()) as s:
        s.settimeout(0.5)
        if s.connect_ex(("127.0.0.1", GLUSTERD_PORT)) == 0:
            return (f"shared-FS rig: port {GLUSTERD_PORT} is taken (a glusterd already runs here); the rig "
                    "starts its own")
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        return f"shared-FS rig: this host's name {socket.gethostname()!r} does not resolve (glusterd needs it)"
    return None


def _first_line(obj: Any) -> str:
    text = getattr(obj, "stderr", None) or str(obj)
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(obj).__name__


# -- the cluster ----------------------------------------------------------------------------------------
@dataclass
class GlusterRig:
    """glusterd + one volume with one brick + two FUSE mounts (``mount_a``, ``mount_b``)."""

    base: str
    mount_opts: str = ""  # extra -o options for both mounts
    volume: str = field(default_factory=lambda: f"gdskv{os.getpid()}")
    host: str = field(default_factory=socket.gethostname)
    started: list[str] = field(default_factory=list)  # what stop() must undo, in order done
    glusterd_pid: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.base = os.path.abspath(self.base)
        if RIG_MARK not in self.base:
            self.base = os.path.join(self.base, RIG_MARK)
        self.workdir = os.path.join(self.base, "glusterd")
        self.brick = os.path.join(self.base, "brick")
        self.mount_a = os.path.join(self.base, "a")
        self.mount_b = os.path.join(self.base, "b")
        self.logs = os.path.join(self.base, "logs")

    # the brick's own directory, for tests that look behind the filesystem's back
    def brick_path(self, rel: str) -> str:
        return os.path.join(self.brick, rel)

    def start(self) -> GlusterRig:
        t0 = time.monotonic()
        for d in (self.workdir, self.brick, self.mount_a, self.mount_b, self.logs):
            os.makedirs(d, exist_ok=True)
        vol = os.path.join(self.base, "glusterd.vol")
        with open(vol, "w") as fh:
            fh.write("volume management\n    type mgmt/glusterd\n"
                     f"    option working-directory {self.workdir}\n"
                     "    option transport-type socket\n"
                     f"    option transport.socket.listen-port {GLUSTERD_PORT}\n"
                     "    option transport.socket.read-fail-log off\n"
                     "    option ping-timeout 0\n    option event-threads 1\nend-volume\n")
        pidfile = os.path.join(self.base, "glusterd.pid")
        self._run(["glusterd", "-f", vol, "-p", pidfile, "-l", os.path.join(self.logs, "glusterd.log")],
                  what="glusterd")
        self.started.append("glusterd")
        self.glusterd_pid = self._read_pid(pidfile)
        self._wait(lambda: self._cli(["volume", "list"], check=False).returncode == 0, 20, "glusterd to answer")
        self._cli(["volume", "create", self.volume, f"{self.host}:{self.brick}", "force"])
        self.started.append("volume")
        self._cli(["volume", "start", self.volume])
        self.started.append("started")
        for mnt, name in ((self.mount_a, "a"), (self.mount_b, "b")):
            opts = f"log-file={os.path.join(self.logs, f'mount-{name}.log')}"
            if self.mount_opts:
                opts += "," + self.mount_opts
            self._run(["mount", "-t", "glusterfs", "-o", opts, f"{self.host}:/{self.volume}", mnt],
                      what=f"mount -t glusterfs at {mnt}")
            self.started.append(mnt)
            self._wait(lambda m=mnt: os.path.ismount(m), 20, f"{mnt} to be mounted")
        # both mounts see one filesystem
        probe = os.path.join(self.mount_a, ".rig-probe")
        with open(probe, "w") as fh:
            fh.write("x")
        self._wait(lambda: os.path.exists(os.path.join(self.mount_b, ".rig-probe")), 10, "mount b to see mount a")
        os.unlink(probe)
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def mount(self, name: str, opts: str = "") -> str:
        """One more FUSE client of the volume at ``<base>/<name>`` (another node's mount, other options);
        unmounted by :meth:`unmount` or :meth:`stop`."""
        mnt = os.path.join(self.base, name)
        os.makedirs(mnt, exist_ok=True)
        all_opts = f"log-file={os.path.join(self.logs, f'mount-{name}.log')}" + (f",{opts}" if opts else "")
        self._run(["mount", "-t", "glusterfs", "-o", all_opts, f"{self.host}:/{self.volume}", mnt],
                  what=f"mount -t glusterfs -o {opts} at {mnt}")
        self.started.append(mnt)
        self._wait(lambda: os.path.ismount(mnt), 20, f"{mnt} to be mounted")
        return mnt

    def unmount(self, mnt: str) -> None:
        if mnt in self.started:
            r = subprocess.run(["umount", mnt], capture_output=True, timeout=60)
            if r.returncode != 0 and os.path.ismount(mnt):
                subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=60)
            self.started.remove(mnt)

    def stop(self) -> list[str]:
        """Undo whatever start() did; never raises.  Returns problems (for the caller to print)."""
        problems: list[str] = []
        extra = [m for m in self.started if m.startswith(self.base + os.sep) and m not in (self.mount_a, self.mount_b)]
        for mnt in (*reversed(extra), self.mount_b, self.mount_a):
            if mnt in self.started:
                r = subprocess.run(["umount", mnt], capture_output=True, timeout=60)
                if r.returncode != 0 and os.path.ismount(mnt):
                    subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=60)
                    problems.append(f"umount {mnt}: {_first_line(r)} (lazily unmounted)")
        if "started" in self.started:
            r = self._cli(["volume", "stop", self.volume, "force"], check=False)
            if r.returncode != 0:
                problems.append(f"volume stop: {_first_line(r)}")
        if "volume" in self.started:
            self._cli(["volume", "delete", self.volume], check=False)
        for pid in self._brick_pids():  # a brick a failed volume stop left running
            _kill(pid)
        if self.glusterd_pid:
            _kill(self.glusterd_pid)
        self.started.clear()
        return problems

    def _brick_pids(self) -> list[int]:
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    cmd = fh.read().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"glusterfsd") and self.brick.encode() in cmd:
                pids.append(int(d))
        return pids

    def brick_log(self) -> str:
        return f"/var/log/glusterfs/bricks/{self.brick.strip('/').replace('/', '-')}.log"

    def _cli(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(["gluster", "--mode=script", *args], capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise RigUnavailable(f"shared-FS rig: `gluster {' '.join(args[:2])}` failed: {_first_line(r)}")
        return r

    def _run(self, cmd: list[str], what: str) -> None:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RigUnavailable(f"shared-FS rig: {what} failed: {_first_line(exc)}") from None
        if r.returncode != 0:
            raise RigUnavailable(f"shared-FS rig: {what} failed (exit {r.returncode}): {_first_line(r)}")

    @staticmethod
    def _wait(cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise RigUnavailable(f"shared-FS rig: timed out waiting for {what}")
            time.sleep(0.1)

    @staticmethod
    def _read_pid(path: str) -> int:
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with open(path) as fh:
                    return int(fh.read().strip())
            except (OSError, ValueError):
                time.sleep(0.05)
        raise RigUnavailable("shared-FS rig: glusterd wrote no pid file")

    def set_option(self, key: str, value: str) -> None:
        self._cli(["volume", "set", self.volume, key, value])


def _kill(pid: int, wait_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, one process the rig started (by pid)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().split(") ", 1)[1].startswith("Z"):  # a zombie: gone, not reaped by us
                        return
            except (ProcessLookupError, FileNotFoundError):
                return
            time.sleep(0.05)


# -- nodes and their owner processes ----------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    """One "node": a host name for its processes and the mount point through which they see the pool."""

    hostname: str
    mount: str

    def path(self, *parts: str) -> str:
        return os.path.join(self.mount, *parts)


def node_command(node: Node, argv: list[str]) -> list[str]:
    """``argv`` (a python script and its arguments) run as a process of ``node``: its own UTS namespace,
    whose host name the child sets first (``--host``)."""
    return ["unshare", "--uts", "--", sys.executable, *argv[:1], "--host", node.hostname, *argv[1:]]


def node_run(node: Node, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120,
             ) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a program on PATH or a path) as a process of ``node`` and wait for it."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    full.update(env or {})
    return subprocess.run(node_command(node, [HERE, "exec", *cmd]), env=full, capture_output=True, text=True,
                          timeout=timeout)


def gds_kv_cli() -> str | None:
    """The package's ``gds-kv`` command: on PATH, else beside this Python (a virtualenv's bin/)."""
    found = shutil.which("gds-kv")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "gds-kv")
    return beside if os.access(beside, os.X_OK) else None


def spawn(node: Node, role: str, spec: dict[str, Any], workdir: str, name: str,
          extra_env: dict[str, str] | None = None) -> Owner:
    """Start one child of ``node`` running ``role`` with ``spec``; its report goes to ``<workdir>/<name>.json``."""
    os.makedirs(workdir, exist_ok=True)
    spec = dict(spec, role=role, report=os.path.join(workdir, f"{name}.json"), name=name)
    spec_path = os.path.join(workdir, f"{name}.spec.json")
    with open(spec_path, "w") as fh:
        json.dump(spec, fh)
    log = open(os.path.join(workdir, f"{name}.log"), "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLLM_GDS_KV_")}
    env.update(extra_env or {})
    proc = subprocess.Popen(node_command(node, [HERE, "child", spec_path]), stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # the checkout's root
    return Owner(name, node, proc, spec["report"], log.name, log)


@dataclass
class Owner:
    name: str
    node: Node
    proc: subprocess.Popen
    report_path: str
    log_path: str
    _log: Any = None

    def wait(self, timeout: float) -> dict[str, Any]:
        """The child's report once it exits; raises with its log's tail if it failed."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not finish within {timeout}s; log tail:\n{self.log_tail()}")
        finally:
            if self._log is not None:
                self._log.close()
        report = self.report()
        if self.proc.returncode != 0 or report is None or report.get("error"):
            raise AssertionError(f"{self.name} on {self.node.hostname} failed (exit {self.proc.returncode}, "
                                 f"error {None if report is None else report.get('error')!r}); log tail:\n"
                                 f"{self.log_tail()}")
        return report

    def report(self) -> dict[str, Any] | None:
        try:
            with open(self.report_path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read()[-n:].decode(errors="replace")
        except OSError:
            return ""


def wait_all(owners: list[Owner], timeout: float) -> list[dict[str, Any]]:
    """Every owner's report; kills the rest as soon as one fails."""
    end = time.monotonic() + timeout
    try:
        while any(o.proc.poll() is None for o in owners):
            if any(o.proc.poll() not in (None, 0) for o in owners):
                break
            if time.monotonic() > end:
                break
            time.sleep(0.1)
        if any(o.proc.poll() not in (None, 0) for o in owners):  # the others stop at the barrier's abort
            settle = time.monotonic() + 10
            while any(o.proc.poll() is None for o in owners) and time.monotonic() < settle:
                time.sleep(0.05)
        bad = [o for o in owners if o.proc.poll() not in (None, 0)]
        # the root cause first: a party that failed on its own, not one the barrier's abort stopped
        bad.sort(key=lambda o: "barrier aborted" in ((o.report() or {}).get("error") or ""))
        if bad:
            bad[0].wait(1)  # raises with its log
        return [o.wait(max(1.0, end - time.monotonic())) for o in owners]
    finally:
        for o in owners:
            o.kill()


class FileBarrier:
    """A barrier for processes on one machine (``wait``/``abort`` as multiprocessing's): files in a
    local directory, one per arrival."""

    def __init__(self, directory: str, parties: int, me: str) -> None:
        self.dir, self.parties, self.me, self.gen = directory, parties, me, 0
        os.makedirs(directory, exist_ok=True)

    def wait(self, timeout: float = 300) -> None:
        gen, self.gen = self.gen, self.gen + 1
        open(os.path.join(self.dir, f"g{gen}-{self.me}"), "w").close()
        end = time.monotonic() + timeout
        while True:
            if os.path.exists(os.path.join(self.dir, "abort")):
                raise RuntimeError("barrier aborted by another party")
            if sum(n.startswith(f"g{gen}-") for n in os.listdir(self.dir)) >= self.parties:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"barrier generation {gen}: not every party arrived in {timeout}s")
            time.sleep(0.02)

    def abort(self) -> None:
        open(os.path.join(self.dir, "abort"), "w").close()


def wait_for_file(path: str, timeout: float, owners: list[Owner] = ()) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        for o in owners:
            if o.proc.poll() not in (None, 0):
                raise AssertionError(f"{o.name} died (exit {o.proc.returncode}):\n{o.log_tail()}")
        if time.monotonic() > end:
            raise AssertionError(f"{path} did not appear in {timeout}s")
        time.sleep(0.02)


def touch(path: str) -> None:
    open(path, "w").close()


# -- an independent check of the pool's files (docs/format.md) ----------------------------------------------
HEADER_SIZE = 4096
BLOCK_MAGIC, REF_MAGIC = b"GDSKVBLK", b"GDSKVREF"
_M64 = (1 << 64) - 1


def _fmix(x):
    import numpy as np
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> np.uint64(33))


def checksum_v1(payload: bytes) -> int:
    """docs/format.md, "Checksum, algorithm 1", written from the spec (not the package's code)."""
    import numpy as np
    n = len(payload)
    padded = payload + b"\0" * (-n % 8)
    w = np.frombuffer(padded, dtype="<u8")
    with np.errstate(over="ignore"):
        i = np.arange(1, len(w) + 1, dtype=np.uint64)
        s = int(_fmix(w ^ (i * np.uint64(0x9E3779B97F4A7C15))).sum(dtype=np.uint64))
        final = _fmix(np.array([(s ^ ((n * 0xC2B2AE3D27D4EB4F) & _M64)) & _M64], dtype=np.uint64))
    return int(final[0])


def check_block_bytes(data: bytes, key_hex: str) -> str | None:
    """Why ``data`` is not a whole, valid v1 block file for ``key_hex``; None if it is."""
    if len(data) < HEADER_SIZE:
        return f"short file ({len(data)} bytes)"
    h = data[:HEADER_SIZE]
    if h[:8] != BLOCK_MAGIC:
        return "bad magic"
    version, hsize = struct.unpack_from("<II", h, 8)
    if version != 1 or hsize != HEADER_SIZE:
        return f"version {version} header size {hsize}"
    if h[48:80].hex() != key_hex:
        return "key in header differs from the name"
    (plen, csum) = struct.unpack_from("<QQ", h, 80)
    if struct.unpack_from("<I", h, 152)[0] != zlib.crc32(h[:152]):
        return "header CRC mismatch"
    if any(h[156:]):
        return "header tail not zero"
    want = HEADER_SIZE + (plen + 4095) // 4096 * 4096
    if len(data) != want:
        return f"size {len(data)}, header says {want}"
    if checksum_v1(data[HEADER_SIZE:HEADER_SIZE + plen]) != csum:
        return "payload checksum mismatch"
    if any(data[HEADER_SIZE + plen:]):
        return "padding not zero"
    return None


def pool_files(root: str) -> dict[str, list[str]]:
    """Paths under ``root``'s layout by kind: ``blk`` (published names), ``tmp`` (temporary files in
    key directories), ``slab`` (arena slabs)."""
    out: dict[str, list[str]] = {"blk": [], "tmp": [], "slab": []}
    layout = os.path.join(root, "gdskv-v1")
    for fp in _ls(layout):
        fp_dir = os.path.join(layout, fp)
        if len(fp) != 16 or not os.path.isdir(fp_dir):
            continue
        for sub in _ls(fp_dir):
            d = os.path.join(fp_dir, sub)
            if sub == "slabs":
                out["slab"] += [os.path.join(d, n) for n in _ls(d)]
            elif len(sub) == 2:
                for n in _ls(d):
                    kind = "blk" if n.endswith(".blk") else "tmp" if n.startswith(".tmp-") else None
                    if kind:
                        out[kind].append(os.path.join(d, n))
    return out


def verify_pool(root: str) -> dict[str, Any]:
    """Read every published name under ``root`` whole and check it by docs/format.md: block files
    completely (header, CRC, size, checksum, padding), reference files by magic, size and CRC.
    Returns counts and the problems found (an empty list: nothing torn or corrupt is visible)."""
    files = pool_files(root)
    problems, blocks, refs = [], 0, 0
    for path in files["blk"]:
        key_hex = os.path.basename(path)[:-4]
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            continue  # evicted meanwhile
        if data[:8] == REF_MAGIC:
            refs += 1
            n = struct.unpack_from("<I", data, 12)[0]
            crc = struct.unpack_from("<I", data, 124)[0]
            if len(data) != 128 + 48 * n or crc != zlib.crc32(data[:124] + data[128:]):
                problems.append(f"{path}: bad reference file")
            continue
        blocks += 1
        why = check_block_bytes(data, key_hex)
        if why:
            problems.append(f"{path}: {why}")
    return {"blocks": blocks, "refs": refs, "tmp": len(files["tmp"]), "slabs": len(files["slab"]),
            "problems": problems, "bytes": sum(_size(p) for p in files["blk"])}


def _ls(d: str) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except OSError:
        return []


def _size(p: str) -> int:
    try:
        return os.stat(p).st_size
    except OSError:
        return 0


def host_tag(host: str) -> str:
    """docs/format.md's host tag, from the spec."""
    host = host.replace("-", "_") or "host"
    ok = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.")
    readable = "".join(c if c in ok else "_" for c in host[:24]) or "host"
    if readable[0] == ".":
        readable = "_" + readable[1:]
    return f"{readable}_{hashlib.sha256(host.encode()).hexdigest()[:8]}"


def owner_files(root: str) -> list[str]:
    return _ls(os.path.join(root, "gdskv-v1", "owners"))


# -- the child ----------------------------------------------------------------------------------------------
def _child(spec_path: str) -> int:
    with open(spec_path) as fh:
        spec = json.load(fh)
    report: dict[str, Any] = {"name": spec["name"], "host": socket.gethostname(), "pid": os.getpid(), "error": ""}
    try:
        report.update(ROLES[spec["role"]](spec))
    except BaseException as exc:
        import traceback
        report["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    tmp = spec["report"] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh)
    os.replace(tmp, spec["report"])
    return 1 if report["error"] else 0


def _connector(spec: dict[str, Any]):
    """A reference executor over a fresh connector pair, with the spec's settings in the environment."""
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    from gds_kv_connector.simulator import ExecutorConfig, ModelShape, ReferenceExecutor, fake_llm_args

    from gds_kv_connector import GdsKvConnectorScheduler, GdsKvConnectorWorker

    shape = ModelShape(**spec.get("shape", {}))
    cfg = ExecutorConfig(shape=shape, **spec.get("cfg", {}))
    llm_args = fake_llm_args(shape.tokens_per_block, attention_dp=True)
    sched, worker = GdsKvConnectorScheduler(llm_args), GdsKvConnectorWorker(llm_args)
    return ReferenceExecutor(sched, worker, cfg), worker


def _evict_lock_probe(worker: Any, log_path: str) -> bool:
    """Log, to a local file, when this process, or the eviction process it starts, holds the pool's
    eviction lock (:mod:`tests.support.evict_lock_log`).  Found from the worker's capacity guard,
    without importing the package's modules by name; False where it is not found."""
    guard = getattr(worker, "capacity", None)
    mod = sys.modules.get(type(guard).__module__) if guard is not None else None
    run = getattr(mod, "evict_pool", None)
    lock_cls = getattr(run, "__globals__", {}).get("EvictLock")
    import evict_lock_log  # beside this script, whose folder leads sys.path in the rig's children

    if not evict_lock_log.install(lock_cls, log_path):
        return False
    if getattr(guard, "runner", "") == "process":  # the run and its lock are in a child: log there too
        guard.child_argv = [sys.executable, evict_lock_log.__file__, log_path]
    return True


def role_serve(spec: dict[str, Any]) -> dict[str, Any]:
    """Serve this owner's share of every round of a shared-prefix workload (conversation ``c`` of round
    ``r`` is owner ``(c + r) % owners``'s, so a conversation moves to the next owner each round); check
    every answer; the executor verifies every loaded block byte for byte.  Options: ``barrier`` (a
    directory; all owners meet between rounds), ``pause`` (round numbers before which the owner
    writes ``<sync>/ready-<name>-r<r>`` and waits for ``<sync>/go-r<r>``), ``evict_log``, ``evict_storm``."""
    from dataclasses import asdict

    from gds_kv_connector.simulator import SimRequest
    from gds_kv_connector.simulator.workload import Workload, answer

    ex, worker = _connector(spec)
    out: dict[str, Any] = {"rounds": [], "data_path": worker.transfers.engine.data_path()}
    if spec.get("evict_log"):
        out["evict_probe"] = _evict_lock_probe(worker, spec["evict_log"])
    wl = Workload(**spec["workload"])
    owner, owners = spec.get("owner", 0), spec.get("owners", 1)
    barrier = FileBarrier(spec["barrier"], owners, spec["name"]) if spec.get("barrier") else None
    sync = spec.get("sync", "")
    prompts = wl.prompts(ex.model)
    arena = getattr(getattr(worker, "pool", None), "arena", None)
    out["arena"] = arena is not None
    try:
        for r, round_prompts in enumerate(prompts):
            if r in spec.get("pause", []):
                touch(os.path.join(sync, f"ready-{spec['name']}-r{r}"))
                wait_for_file(os.path.join(sync, f"go-r{r}"), 300)
            before = asdict(ex.stats)
            io0 = worker.stats.snapshot()
            mine = [c for c in range(wl.conversations) if (c + r) % owners == owner]
            for c in mine:
                ex.submit(SimRequest(request_id=r * 10_000 + c, prompt=round_prompts[c],
                                     max_new_tokens=wl.answer_tokens))
            t0 = time.perf_counter()
            ex.run_until_done()
            wall = time.perf_counter() - t0
            for c in mine:
                if ex.output_tokens(r * 10_000 + c) != answer(ex.model, round_prompts[c], wl.answer_tokens):
                    raise AssertionError(f"wrong answer for conversation {c} round {r}")
            after, io1 = asdict(ex.stats), worker.stats.snapshot()
            row = {k: after[k] - before[k] for k in ("prompt_tokens", "loaded_tokens", "computed_tokens",
                                                      "blocks_verified")}
            row.update({k: io1.get(k, 0) - io0.get(k, 0) for k in ("blocks_saved", "bytes_saved", "bytes_loaded")})
            row.update(round=r, requests=len(mine), wall_s=wall)
            out["rounds"].append(row)
            if sync:
                touch(os.path.join(sync, f"done-{spec['name']}-r{r}"))
            if barrier is not None:
                barrier.wait(300)
        if spec.get("evict_storm"):
            storm = spec["evict_storm"]
            if barrier is not None:
                barrier.wait(300)
            time.sleep(storm.get("sleep_s", 0))
            jitter = random.Random(os.getpid())
            for _ in range(storm.get("runs", 5)):
                worker.capacity.check_now(timeout=60)
                time.sleep(jitter.uniform(0, storm.get("gap_s", 0)))  # lets each node's runs meet the other's
            out["last_evict"] = [vars(rep) for rep in worker.capacity.last_reports]
        if spec.get("hold_s"):
            time.sleep(spec["hold_s"])
    except BaseException:
        if barrier is not None:
            barrier.abort()
        raise
    finally:
        worker.shutdown()
        out["connector"] = worker.stats.snapshot()
    return out


def role_evict(spec: dict[str, Any]) -> dict[str, Any]:
    """An owner that serves nothing and runs its evictor on a signal: each name in ``steps`` is
    ``[wait_for, sleep_s, then_touch]``: wait for the file, sleep, run one eviction run
    (``capacity.check_now``), touch the file.  Reports each run."""
    _, worker = _connector(spec)  # the executor registers the KV cache, which starts the worker's pool
    runs = []
    try:
        for wait_path, sleep_s, then in spec["steps"]:
            wait_for_file(wait_path, 300)
            time.sleep(sleep_s)
            t0 = time.time()
            worker.capacity.check_now(timeout=60)
            runs.append({"t0": t0, "t1": time.time(), "reports": [vars(r) for r in worker.capacity.last_reports]})
            touch(then)
    finally:
        worker.shutdown()
    return {"runs": runs, "connector": worker.stats.snapshot()}


def role_sleep(spec: dict[str, Any]) -> dict[str, Any]:
    """Nothing but the host name (the tests check the namespace)."""
    return {"gethostname": socket.gethostname()}


ROLES = {"serve": role_serve, "evict": role_evict, "sleep": role_sleep}


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "--host" and argv[2] == "child":
        socket.sethostname(argv[1])  # before anything imports the package: it reads the name at import
        if socket.gethostname() != argv[1]:
            raise SystemExit(f"host name is {socket.gethostname()!r}, not {argv[1]!r}")
        return _child(argv[3])
    if len(argv) >= 4 and argv[0] == "--host" and argv[2] == "exec":
        socket.sethostname(argv[1])
        os.execvp(argv[3], argv[3:])
    print("usage: shared_fs_rig.py --host NAME child SPEC.json | --host NAME exec CMD...  (started by the tests)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
