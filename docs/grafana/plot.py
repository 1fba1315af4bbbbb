"""Draw the dashboard's panels (gds-kv.json) from a Prometheus server's data into one PNG.

Each panel's queries run through Prometheus's ``/api/v1/query_range`` over the given window, so the
picture shows what Grafana would, without Grafana.  ``tests/integration/test_prometheus.py`` calls
it for its real run when ``GDSKV_PLOT_DASHBOARD`` names the PNG to write; by hand::

    python docs/grafana/plot.py --prometheus http://127.0.0.1:9090 --minutes 15 --out dashboard.png

Needs matplotlib (not a dependency of the package: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import urllib.parse
import urllib.request
from typing import Any

GRAFANA_INTERVAL = "$__rate_interval"
UNIT_SCALE = {"percentunit": (100.0, "%"), "s": (1e3, "ms"), "Bps": (1 / 2**20, "MiB/s"),
              "bytes": (1 / 2**20, "MiB"), "short": (1.0, "")}


def dashboard_queries(dashboard: dict[str, Any], rate_interval: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(title, unit, [(expr, legend)]) per panel, ``$__rate_interval`` replaced by ``rate_interval``."""
    return [(p["title"], p["fieldConfig"]["defaults"].get("unit", "short"),
             [(t["expr"].replace(GRAFANA_INTERVAL, rate_interval), t.get("legendFormat", ""))
              for t in p["targets"]])
            for p in dashboard["panels"]]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """The matrix Prometheus returns for ``expr`` (``/api/v1/query_range``)."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=10) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend filled in from a series' labels."""
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def plot(prometheus: str, dashboard_path: str, out: str, start: float, end: float, step: float = 1.0,
         rate_interval: str = "1m") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(dashboard_path) as fh:
        panels = dashboard_queries(json.load(fh), rate_interval)
    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(14, 3.2 * rows), squeeze=False)
    for ax, (title, unit, targets) in zip(axes.flat, panels):
        scale, label = UNIT_SCALE.get(unit, (1.0, unit))
        for expr, template in targets:
            for series in query_range(prometheus, expr, start, end, step):
                points = [(float(t) - start, float(v) * scale) for t, v in series["values"]]
                ax.plot([p[0] for p in points], [p[1] for p in points], label=legend(template, series["metric"]),
                        linewidth=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(label)
        ax.set_xlabel("s")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"gds-kv dashboard ({os.path.basename(dashboard_path)}), rates over {rate_interval}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus server URL")
    p.add_argument("--dashboard", default="docs/grafana/gds-kv.json", help="the dashboard JSON")
    p.add_argument("--minutes", type=float, default=15.0, help="window, ending now")
    p.add_argument("--rate-interval", default="1m", help="what $__rate_interval becomes")
    p.add_argument("--out", default="dashboard.png")
    args = p.parse_args()
    end = time.time()
    plot(args.prometheus, args.dashboard, args.out, end - 60 * args.minutes, end,
         step=max(1.0, args.minutes * 60 / 600), rate_interval=args.rate_interval)


if __name__ == "__main__":
    main()
