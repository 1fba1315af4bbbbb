"""``gds-kv``: the demo, the settings reference, and operator commands.

Exit codes: 0 success, 1 the command ran and found a problem (a failed demo, bad blocks,
a pool over quota), 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gds_kv_connector.config.settings import ENV_PREFIX, Settings, SettingsError, settings_table

DEFAULT_DEMO_ROOT = "./gds-kv-pool"


def _roots(args: argparse.Namespace) -> list[str]:
    """Every root of the pool (``--root`` or the setting, ``:``-separated): the operator commands
    cover them all, as the connector spreads blocks over them all."""
    root = args.root or os.environ.get(ENV_PREFIX + "ROOT", "")
    roots = [r for r in root.split(":") if r]
    if not roots:
        raise SettingsError(f"no pool root: pass --root or set {ENV_PREFIX}ROOT")
    return roots


def cmd_demo(args: argparse.Namespace) -> int:
    from gds_kv_connector.cli.demo import main
    root = args.root or os.environ.get(ENV_PREFIX + "ROOT") or DEFAULT_DEMO_ROOT
    return main(root, device=args.device, owners=args.owners, conversations=args.conversations,
                rounds=args.rounds, json_out=args.json, progress=not args.no_progress)


def cmd_settings(args: argparse.Namespace) -> int:
    rows = settings_table()
    if args.markdown:
        from gds_kv_connector.config.reference import markdown
        print(markdown(), end="")
        return 0
    if args.json:
        print(json.dumps([{"env": e, "default": d, "meaning": m} for e, d, m in rows], indent=1))
        return 0
    if args.check:
        s = Settings.load_from(require_root=True)
        print(f"settings OK: pool root(s) {', '.join(s.roots)}")
        return 0
    for env, default, meaning in rows:
        print(f"{env}\n    default: {default}\n    {meaning}")
    return 0


def _emit(args: argparse.Namespace, result: dict, text: str) -> int:
    print(json.dumps(result, indent=1, default=str) if args.json else text)
    return int(result.get("exit_code", 0))


def cmd_doctor(args: argparse.Namespace) -> int:
    from gds_kv_connector.cli.doctor import doctor_report, format_doctor
    report = doctor_report(args.root or os.environ.get(ENV_PREFIX + "ROOT") or None)
    return _emit(args, report, format_doctor(report))


def cmd_stats(args: argparse.Namespace) -> int:
    from gds_kv_connector.maintenance.operations import format_stats, stats
    result = stats(_roots(args))
    return _emit(args, result, format_stats(result))


def cmd_gc(args: argparse.Namespace) -> int:
    from gds_kv_connector.maintenance.operations import format_gc, gc
    s = Settings.load_from(require_root=False)
    quota = args.quota if args.quota is not None else s.quota_bytes
    result = gc(_roots(args), quota, s.low_watermark, args.max_age_s, min_free_bytes=s.min_free_bytes,
                grace_s=s.evict_grace_s, dry_run=args.dry_run, legacy_slabs=args.legacy_slabs)
    return _emit(args, result, format_gc(result))


def cmd_verify(args: argparse.Namespace) -> int:
    from gds_kv_connector.maintenance.operations import format_verify, verify
    result = verify(_roots(args), workers=args.workers, progress=not args.json, quarantine=not args.no_quarantine)
    return _emit(args, result, format_verify(result))


def cmd_bench(args: argparse.Namespace) -> int:
    from gds_kv_connector.bench.main import main as bench_main
    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gds-kv", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="shared-prefix workload through 2 ADP owners, then a restart")
    d.add_argument("--root", help=f"pool directory (default: ${ENV_PREFIX}ROOT or {DEFAULT_DEMO_ROOT})")
    d.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    d.add_argument("--owners", type=int, default=2)
    d.add_argument("--conversations", type=int, default=6)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--json", help="also write the summary as JSON to this file")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(fn=cmd_demo)
    s = sub.add_parser("settings", help="list every TLLM_GDS_KV_* setting, or --check the current environment")
    s.add_argument("--json", action="store_true", help="the table as JSON")
    s.add_argument("--markdown", action="store_true", help="the table as docs/configuration.md")
    s.add_argument("--check", action="store_true", help="validate this environment's settings and roots")
    s.set_defaults(fn=cmd_settings)
    for name, fn, help_ in (("doctor", cmd_doctor, "what this machine supports (GDS, cuFile, O_DIRECT, filesystem)"),
                            ("stats", cmd_stats, "blocks, bytes, per-fingerprint breakdown, owners' counters"),
                            ("gc", cmd_gc, "evict to the quota now, expire blocks by age, remove arena slabs "
                                                  "no owner holds or names"),
                            ("verify", cmd_verify, "re-check every header and checksum; quarantine bad files")):
        c = sub.add_parser(name, help=help_)
        c.add_argument("--root", help=f"pool root, or all the roots of a pool separated by ':' "
                                      f"(default: ${ENV_PREFIX}ROOT)")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        c.set_defaults(fn=fn)
        if name == "gc":
            from gds_kv_connector.config.settings import parse_size
            c.add_argument("--quota", type=parse_size, help=f"byte budget (default: ${ENV_PREFIX}QUOTA_BYTES)")
            c.add_argument("--max-age-s", type=float, default=0.0, help="also remove blocks older than this")
            c.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
            c.add_argument("--legacy-slabs", action="store_true",
                           help="also take arena slabs named before host tags with this host's first 32 characters "
                                "for this host's (only once no older version runs on a host sharing them)")
        if name == "verify":
            c.add_argument("--workers", type=int, default=8)
            c.add_argument("--no-quarantine", action="store_true", help="report bad files but leave them")
    b = sub.add_parser("bench", help="bandwidth and executor-cost benchmark (gds-kv bench --help)",
                       add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # bench has its own options; hand them over untouched
        argv = ["bench", "--", *argv[1:]] if argv[1:2] != ["--"] else argv
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (SettingsError, ValueError) as exc:  # includes operations.UsageError
        print(f"gds-kv: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a root or file the command could not read or change: say which, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"gds-kv: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
