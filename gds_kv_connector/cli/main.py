"""``gds-kv``: the demo, the settings reference, operator commands and the metrics exporter.

Exit codes: 0 success, 1 the command ran and found a problem (a failed demo, bad blocks, a pool over
quota, an unusable root), 2 bad usage or configuration, 130 or 143 interrupted (SIGINT, SIGTERM), 141
when the reader of the output went away (``gds-kv stats | head -1``), as for a process SIGPIPE ended.

Every command but the settings reference reads the settings as the connector does (environment
variables, then the ``TLLM_GDS_KV_CONFIG`` file) and refuses a bad one before doing anything; a bad
setting or option is one line on stderr naming it and what it allows, with the closest known name
for a near miss.  Only the commands that move KV (demo, bench) import torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
from typing import Any, Callable, NoReturn

from gds_kv_connector.config.settings import (CONFIG_ENV, ENV_PREFIX, Settings, SettingsError, did_you_mean,
                                              parse_size, settings_table)

DEFAULT_DEMO_ROOT = "./gds-kv-pool"
# The exporter's port: not 9400, the port first suggested, which is dcgm-exporter's (the GPU Operator
# runs it on every GPU node)
DEFAULT_METRICS_PORT = 9479
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_OUTPUT_CLOSED = 128 + signal.SIGPIPE


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: the message, the closest command or option for a near
    miss, and where the help is (argparse's own usage lines went before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}{self._hint(message)} (see {self.prog} --help)\n")

    def _hint(self, message: str) -> str:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            return did_you_mean(choice[1], [c.strip(" '") for c in choice[2].split(",")])
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            options = list(self._option_string_actions)
            return "".join(did_you_mean(t.split("=")[0], options) for t in unknown[1].split() if t.startswith("-"))
        return ""


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An option's type: a whole number from ``low`` (to ``high``), or the one line saying so."""
    allowed = f"a whole number from {low} to {high}" if high is not None else f"a whole number of at least {low}"

    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]{1,18}", text.strip()) or not low <= int(text) <= (high or math.inf):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return int(text)
    return parse


def _seconds(text: str) -> float:
    """An option's type: a finite, non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text!r}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _settings() -> Settings:
    """The settings as the connector reads them, checked: a bad one stops the command here."""
    return Settings.load_from(require_root=False)


def _roots(args: argparse.Namespace, settings: Settings) -> list[str]:
    """Every root of the pool (``--root``, else the setting, ``:``-separated): the operator commands
    cover them all, as the connector spreads blocks over them all."""
    roots = [r for r in (args.root or settings.root).split(":") if r]
    if not roots:
        raise SettingsError(f"no pool root: pass --root, or set {ENV_PREFIX}ROOT (or root in the {CONFIG_ENV} file)")
    return roots


def cmd_demo(args: argparse.Namespace) -> int:
    settings = _settings()
    from gds_kv_connector.cli.demo import main
    return main(args.root or settings.root or DEFAULT_DEMO_ROOT, device=args.device, owners=args.owners,
                conversations=args.conversations, rounds=args.rounds, json_out=args.json,
                progress=not args.no_progress)


def cmd_settings(args: argparse.Namespace) -> int:
    """The settings reference (never refused: it is where a bad setting is looked up), or ``--check``."""
    if args.check:
        return _check_settings()
    rows = settings_table()
    if args.markdown:
        from gds_kv_connector.config.reference import markdown
        print(markdown(), end="")
    elif args.json:
        print(json.dumps([{"env": e, "default": d, "meaning": m} for e, d, m in rows], indent=1))
    else:
        for env, default, meaning in rows:
            print(f"{env}\n    default: {default}\n    {meaning}")
    return 0


def _check_settings() -> int:
    """Settings as a serving owner reads them, and each root one it can serve from (doctor's test)."""
    from gds_kv_connector.cli.doctor import root_facts

    s = Settings.load_from(require_root=True)
    facts = [root_facts(r, s.arena_bytes) for r in s.roots]
    bad = [f"{f['path']} {f['problem']}" for f in facts if f["problem"]]
    if bad:
        raise SettingsError(f"pool root {'; '.join(bad)}: {ENV_PREFIX}ROOT must name directories this process "
                            "can create files in, with room for the slot arena")
    print(f"settings OK: pool root(s) {', '.join(map(_describe_root, facts))}")
    return 0


def _describe_root(facts: dict[str, Any]) -> str:
    if not facts["exists"]:
        return f"{facts['path']} ({facts['note']})"
    odirect = "yes" if facts["o_direct_write"] else f"no, {facts['o_direct_error']}"
    return f"{facts['path']} ({facts['fs_type']}, O_DIRECT {odirect}, {facts['free_bytes'] / 2**30:.1f} GiB free)"


def _emit(args: argparse.Namespace, result: dict, text: str) -> int:
    print(json.dumps(result, indent=1, default=str) if args.json else text)
    return int(result.get("exit_code", 0))


def cmd_doctor(args: argparse.Namespace) -> int:
    settings = _settings()
    from gds_kv_connector.cli.doctor import doctor_report, format_doctor
    report = doctor_report(args.root or settings.root or None)
    return _emit(args, report, format_doctor(report))


def cmd_stats(args: argparse.Namespace) -> int:
    from gds_kv_connector.maintenance.operations import format_stats, stats
    result = stats(_roots(args, _settings()), exact=args.exact)
    return _emit(args, result, format_stats(result))


def cmd_gc(args: argparse.Namespace) -> int:
    from gds_kv_connector.maintenance.operations import format_gc, gc
    s = _settings()
    quota = args.quota if args.quota is not None else s.quota_bytes
    result = gc(_roots(args, s), quota, s.low_watermark, args.max_age_s, min_free_bytes=s.min_free_bytes,
                grace_s=s.evict_grace_s, dry_run=args.dry_run, legacy_slabs=args.legacy_slabs)
    return _emit(args, result, format_gc(result))


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify this process's shard of the pool, resumable: SIGINT or SIGTERM saves the state and
    says how to go on (exit 128 + the signal's number)."""
    from gds_kv_connector.maintenance.verify import VerifyInterrupted, format_verify, verify
    from gds_kv_connector.maintenance.verify_state import Shard, default_state_path
    roots = _roots(args, _settings())
    shard = args.shard or Shard()
    state = args.state if args.state is not None else default_state_path(roots, shard)
    tty = sys.stderr.isatty()  # a bar's carriage returns never go into a log file: lines there
    caught: list[int] = []
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if caught:  # a second signal: stop now, from the last state saved
            raise KeyboardInterrupt
        caught.append(signum)
        stop.set()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = verify(roots, workers=args.workers, progress=not args.no_progress,
                        quarantine=not args.no_quarantine, shard=shard, state_path=state,
                        restart=args.restart, state_optional=args.state is None,
                        progress_every_s=None if tty else args.progress_every_s, stop=stop)
    except VerifyInterrupted as stopped:
        saved = (f"state saved in {stopped.state_path}: run the same command again to resume (--restart starts "
                 "over)" if stopped.state_path else "no state could be saved: a new run starts over")
        print(f"gds-kv verify: interrupted by {signal.Signals(caught[0]).name}, {stopped.shards_done} of "
              f"{stopped.shards_total} shard directories done, {saved}", file=sys.stderr)
        return 128 + caught[0]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _emit(args, result, format_verify(result))


def _shard(text: str) -> Any:
    """An option's type: ``I/N``, this process's part of the pool's shard directories."""
    from gds_kv_connector.maintenance.verify_state import Shard
    try:
        return Shard.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_metrics(args: argparse.Namespace) -> int:
    """The pool's metrics once (Prometheus's text format), or ``--serve`` them to scrapes until
    SIGINT or SIGTERM."""
    from gds_kv_connector.maintenance.prometheus import exposition, listen
    roots = _roots(args, _settings())
    for root in roots:
        if not os.path.isdir(root):
            raise SettingsError(f"pool root {root} is not a directory")
    if not args.serve:
        print(exposition(roots), end="")
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server, thread = listen(roots, args.address, args.port)
    print(f"gds-kv metrics: serving http://{args.address or '*'}:{server.server_port}/metrics for "
          f"{':'.join(roots)}", file=sys.stderr, flush=True)
    stop.wait()
    server.shutdown()
    server.server_close()
    thread.join()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if not {"-h", "--help"} & set(args.rest):
        _settings()
    from gds_kv_connector.bench.main import main as bench_main
    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gds-kv", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    d = _command(sub, "demo", cmd_demo, "shared-prefix workload through 2 ADP owners, then a restart")
    d.add_argument("--root", help=f"pool directory (default: ${ENV_PREFIX}ROOT or {DEFAULT_DEMO_ROOT})")
    d.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the KV cache lives (auto: cuda where torch sees a GPU)")
    d.add_argument("--owners", type=_whole(1, 64), default=2, help="owner processes in the first phase (1-64)")
    d.add_argument("--conversations", type=_whole(1), default=6, help="conversations sharing the system prompt")
    d.add_argument("--rounds", type=_whole(1), default=3, help="rounds of each conversation")
    d.add_argument("--json", help="also write the summary as JSON to this file")
    d.add_argument("--no-progress", action="store_true", help="no progress bars (drawn only on a terminal)")
    s = _command(sub, "settings", cmd_settings, "list every TLLM_GDS_KV_* setting, or --check the current "
                 "environment")
    s.add_argument("--json", action="store_true", help="the table as JSON")
    s.add_argument("--markdown", action="store_true", help="the table as docs/configuration.md")
    s.add_argument("--check", action="store_true", help="validate this environment's settings, and that each root "
                   "is a directory this process can create files in, with room for the arena")
    for name, fn, help_ in (("doctor", cmd_doctor, "what this machine supports (GDS, cuFile, O_DIRECT, filesystem) "
                             "and whether each root is usable"),
                            ("stats", cmd_stats, "blocks, bytes, per-fingerprint breakdown, owners' counters"),
                            ("gc", cmd_gc, "evict to the quota now, expire blocks by age, remove arena slabs "
                                           "no owner holds or names"),
                            ("verify", cmd_verify, "re-check every header and checksum; quarantine bad files"),
                            ("metrics", cmd_metrics, "the owners' counters, latencies and gauges for Prometheus "
                                                     "(--serve: an exporter)")):
        c = _command(sub, name, fn, help_)
        c.add_argument("--root", help=f"pool root, or all the roots of a pool separated by ':' "
                                      f"(default: ${ENV_PREFIX}ROOT)")
        if name != "metrics":
            c.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "stats":
            c.add_argument("--exact", action="store_true", help="list and lstat every block instead of reading the "
                           "shard summaries (time and memory follow the pool's size)")
        if name == "gc":
            c.add_argument("--quota", type=_size, help=f"byte budget (default: ${ENV_PREFIX}QUOTA_BYTES)")
            c.add_argument("--max-age-s", type=_seconds, default=0.0, help="also remove blocks older than this")
            c.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
            c.add_argument("--legacy-slabs", action="store_true",
                           help="also take arena slabs named before host tags with this host's first 32 characters "
                                "for this host's (only once no older version runs on a host sharing them)")
        if name == "verify":
            _verify_options(c)
        if name == "metrics":
            _metrics_options(c)
    b = _command(sub, "bench", cmd_bench, "bandwidth and executor-cost benchmark (gds-kv bench --help)",
                 add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _command(sub: Any, name: str, fn: Callable[[argparse.Namespace], int], help_: str,
             **kw: Any) -> argparse.ArgumentParser:
    c = sub.add_parser(name, help=help_, description=help_, **kw)
    c.set_defaults(fn=fn, parser=c)
    return c


def _verify_options(c: argparse.ArgumentParser) -> None:
    c.add_argument("--workers", type=_whole(1, 256), default=8, help="files checked at once (1-256)")
    c.add_argument("--no-quarantine", action="store_true", help="report bad files but leave them")
    c.add_argument("--shard", type=_shard, metavar="I/N",
                   help="verify only the shard directories of process I of N (from 0; default 0/1, all): N "
                        "processes, on any nodes, verify the pool once")
    c.add_argument("--state", help="record progress here and resume from it (default: owners/verify-I-of-N.json "
                                   "in the first root; removed when the run ends)")
    c.add_argument("--restart", action="store_true", help="ignore the state of an earlier run and start over")
    c.add_argument("--no-progress", action="store_true", help="no progress on stderr (a bar on a terminal, "
                                                              "else a line every --progress-every seconds)")
    c.add_argument("--progress-every", dest="progress_every_s", type=_seconds, default=10.0, metavar="S",
                   help="seconds between progress lines when stderr is not a terminal (default 10)")


def _metrics_options(c: argparse.ArgumentParser) -> None:
    c.add_argument("--serve", action="store_true", help="answer Prometheus's scrapes until stopped (SIGINT, SIGTERM); "
                   "without it the metrics are printed once")
    c.add_argument("--port", type=_whole(0, 65535), default=DEFAULT_METRICS_PORT,
                   help=f"port to serve on (default {DEFAULT_METRICS_PORT}; 0: any free one)")
    c.add_argument("--address", default="", help="address to serve on (default: every interface)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # bench has its own options; hand them over untouched
        argv = ["bench", "--", *argv[1:]] if argv[1:2] != ["--"] else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _output_closed()
    except (SettingsError, ValueError) as exc:  # includes operations.UsageError
        print(f"gds-kv {args.cmd}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a root or file the command could not read or change: say which, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"gds-kv {args.cmd}: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _output_closed() -> int:
    """The reader of stdout went away (``| head``): stop quietly, as a process SIGPIPE ends would.
    Stdout then points at /dev/null, so the interpreter's last flush finds no broken pipe to report."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OUTPUT_CLOSED


if __name__ == "__main__":
    sys.exit(main())
