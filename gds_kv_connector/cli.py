"""``gds-kv``: the demo, the settings reference, and operator commands.

Exit codes: 0 success, 1 the command ran and found a problem (a failed demo, bad blocks,
a pool over quota), 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .settings import ENV_PREFIX, Settings, SettingsError, settings_table

DEFAULT_DEMO_ROOT = "./gds-kv-pool"


def _root(args: argparse.Namespace) -> str:
    root = args.root or os.environ.get(ENV_PREFIX + "ROOT", "")
    if not root:
        raise SettingsError(f"no pool root: pass --root or set {ENV_PREFIX}ROOT")
    return root.split(":")[0]


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main
    root = args.root or os.environ.get(ENV_PREFIX + "ROOT") or DEFAULT_DEMO_ROOT
    return main(root, device=args.device, owners=args.owners, conversations=args.conversations,
                rounds=args.rounds, json_out=args.json, progress=not args.no_progress)


def cmd_settings(args: argparse.Namespace) -> int:
    rows = settings_table()
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
    s.add_argument("--json", action="store_true")
    s.add_argument("--check", action="store_true")
    s.set_defaults(fn=cmd_settings)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except SettingsError as exc:
        print(f"gds-kv: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
