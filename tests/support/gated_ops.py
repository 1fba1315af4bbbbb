"""Storage whose transfers of chosen blocks wait until the test lets them go, and a TransferManager over it.

Backlog, priority and fence tests need a transfer that is *running* (its bytes are moving) or
*queued* (no transfer thread took it) at a moment the test picks, without sleeping for it: a held
block's first ``pwrite`` / ``preadv`` blocks on an event, so the batch carrying it is running and
every batch behind it (one transfer thread) is queued.  A block's file is opened under a name that
holds its key's hex (the temporary file of a save, the block file of a load), so each descriptor's
path says whose bytes it moves.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from tests.support import fault_helpers as fh
from gds_kv_connector.engines.posix import PosixEngine
from gds_kv_connector.engines.staged_files import StagedFileIo
from gds_kv_connector.engines.fileops import FileOps
from gds_kv_connector.transfer.jobs import SaveOp
from gds_kv_connector.config.settings import Settings
from gds_kv_connector.util.counters import Stats
from gds_kv_connector.transfer.manager import TransferManager
from tests.unit.engines.test_staged_files import _from_host, _to_host  # memmove in place of the DMA

WAIT_S = 10.0  # no event a test waits for takes this long unless the code under test is broken


@dataclass
class Gate:
    started: threading.Event = field(default_factory=threading.Event)  # the held transfer began
    go: threading.Event = field(default_factory=threading.Event)  # set by the test: let it move

    def release(self) -> None:
        self.go.set()


class GatedOps(FileOps):
    """FileOps whose transfers of held keys wait for their gate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: dict[int, str] = {}
        self._gates: dict[str, Gate] = {}
        self._begun: set[int] = set()
        self.moved: list[str] = []  # file name of each transfer begun

    def did_move(self, key: bytes) -> bool:
        with self._lock:
            return any(key.hex() in name for name in self.moved)

    def hold(self, key: bytes) -> Gate:
        gate = Gate()
        with self._lock:
            self._gates[key.hex()] = gate
        return gate

    def release_all(self) -> None:
        with self._lock:
            gates = list(self._gates.values())
        for gate in gates:
            gate.release()

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        if path.startswith("/proc/self/fd/"):  # a second descriptor of an open file (the staged path's O_DIRECT one)
            path = os.readlink(path)
        with self._lock:
            self._paths[fd] = path
            self._begun.discard(fd)
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._paths.pop(fd, None)
        super().close(fd)

    def _enter(self, fd: int) -> None:
        with self._lock:
            path = self._paths.get(fd, "")
            first = fd not in self._begun
            self._begun.add(fd)
            name = path.rsplit("/", 1)[-1]
            hexkey = next((k for k in self._gates if k in name), None)
            if first:
                self.moved.append(name)
            gate = self._gates.get(hexkey) if hexkey else None
        if gate is not None:
            gate.started.set()
            assert gate.go.wait(WAIT_S), f"block {hexkey[:12]} was held for {WAIT_S}s: the test never let it go"

    def pwrite(self, fd: int, data, offset: int) -> int:
        self._enter(fd)
        return super().pwrite(fd, data, offset)

    def preadv(self, fd: int, buf, offset: int) -> int:
        self._enter(fd)
        return super().preadv(fd, buf, offset)


class HeldEvent:
    """The forward's CUDA event, held: the batch waiting on it is running (a transfer thread took it)
    and moves no byte until the test sets ``go``."""

    def __init__(self) -> None:
        self.started, self.go = threading.Event(), threading.Event()

    def synchronize(self) -> None:
        self.started.set()
        assert self.go.wait(WAIT_S)


def wait_until(cond, what: str = "the condition") -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, f"waited {WAIT_S}s for {what}"
        time.sleep(0.001)


def release_when(cond, gates: list[Gate]) -> None:
    """Open the gates from another thread once ``cond()`` holds (a fence or shutdown has marked a
    batch stopped, say), while this thread blocks in the call that sets it."""
    def run() -> None:
        wait_until(cond)
        for gate in gates:
            gate.release()
    threading.Thread(target=run, daemon=True).start()


class StagedHostEngine(PosixEngine):
    """The staged O_DIRECT path (what KvikIO's engine runs without GDS) over host memory: payloads
    copied to a stage with memmove in place of the DMA, then written from it."""

    def __init__(self, io_threads: int, ops: FileOps) -> None:
        super().__init__(io_threads=io_threads, ops=ops)
        self.staged = StagedFileIo(_to_host, _from_host, lambda *a: None, lambda *a: None, io_threads, ops=ops)

    def write(self, items, in_time=None, views_read=None):
        return self.staged.write(items, in_time, views_read)

    def read(self, items, in_time=None):
        return self.staged.read(items, in_time)

    def close(self) -> None:
        self.staged.close()
        super().close()


class GatedRig:
    """A TransferManager over a fresh pool, every file operation through one :class:`GatedOps`;
    with ``staged``, its engine stages payloads as the GPU data path does (:class:`StagedHostEngine`)."""

    def __init__(self, root: str, num_blocks: int = 32, staged: bool = False, **env: str) -> None:
        self.ops = GatedOps()
        base = {"TLLM_GDS_KV_DEADLINE_S": "20", "TLLM_GDS_KV_CONTROL_GRACE_S": "5",
                "TLLM_GDS_KV_TRANSFER_THREADS": "1"}
        base.update(env)
        self.settings = Settings.load_from(env=base, require_root=False, root=root)
        self.pool = fh.make_pool(root, ops=self.ops, index_ttl_s=0.0)
        self.engine = StagedHostEngine(2, self.ops) if staged else PosixEngine(io_threads=2, ops=self.ops)
        self.kv = fh.make_kv(num_blocks)
        self.stats = Stats()
        self.tm = TransferManager(self.pool, self.engine, self.kv, self.settings, self.stats)
        self.reported: list[tuple[str, int]] = []  # ("saved" | "loaded", request id), every report

    def save_op(self, rid: int, tag: str, n: int, first_block: int) -> SaveOp:
        keys = [fh.key_of(tag, rid, j) for j in range(n)]
        for i, k in enumerate(keys):
            fh.fill(self.kv, first_block + i, k)
        return SaveOp(rid, tuple(keys), tuple([b""] * n), tuple(range(first_block, first_block + n)))

    def running_save(self, rid: int, tag: str, n: int = 1, first_block: int = 0) -> tuple[SaveOp, Gate]:
        """A save of ``n`` blocks submitted and held in the storage at its first write, so it is
        running (on the rig's one transfer thread) and every batch behind it waits; its gate."""
        op = self.save_op(rid, tag, n, first_block)
        gate = self.ops.hold(op.keys[0])
        self.tm.submit_saves([op], None)
        assert gate.started.wait(WAIT_S)
        return op, gate

    def writing(self, ops: list[SaveOp], held: list[bytes]) -> list[Gate]:
        """Submit ``ops`` together with the first write of each ``held`` key held, once every one of
        those writes has begun (two held keys occupy the rig engine's two I/O threads); their gates."""
        gates = [self.ops.hold(k) for k in held]
        self.tm.submit_saves(ops, None)
        assert all(g.started.wait(WAIT_S) for g in gates)
        return gates

    def poll(self, finished=(), loading=()) -> tuple[list[int], list[int]]:
        saved, loaded = self.tm.poll(list(finished), list(loading))
        self.reported += [("saved", rid) for rid in saved] + [("loaded", rid) for rid in loaded]
        return saved, loaded

    def poll_until(self, want_saved=(), want_loaded=(), timeout: float = WAIT_S) -> None:
        """Poll (passing nothing new) until every wanted id was reported, each at most once."""
        end = time.monotonic() + timeout
        while not ({("saved", r) for r in want_saved} | {("loaded", r) for r in want_loaded}) <= set(self.reported):
            assert time.monotonic() < end, f"not reported within {timeout}s: {self.reported}"
            self.poll()
            time.sleep(0.002)
        assert len(self.reported) == len(set(self.reported)), f"a request was reported twice: {self.reported}"

    def close(self) -> None:
        self.ops.release_all()
        self.tm.shutdown()
