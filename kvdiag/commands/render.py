"""``kvdiag render``: write the monitoring mixin generated from the checklist's catalog.

Writes ``rules/`` (recording + alerting rules), ``dashboards/`` (Grafana JSON),
``deploy/grafana/provisioning/alerting/`` (Grafana-managed alerts), ``docs/runbooks.md`` and
``deploy/kubernetes/prometheusrule.yaml`` (the rules as a Prometheus Operator object).
``--check`` writes nothing and exits 1 listing the files that differ from a fresh render (the
CI guard against hand edits and forgotten regenerations, like vLLM's dashboard ``--check``).
Thresholds come from the same config as ``diagnose`` (``--config``, ``--set``); ``--for
SEVERITY=DURATION`` changes how long alerts of a severity (or the ``absent`` guard) wait;
``--interval`` every rule group's evaluation interval (set it to the engines' scrape interval).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvdiag.config import parse_duration, resolve
from kvdiag.render import render_all
from kvdiag.render.grafana_alerts import DATASOURCE_UID
from kvdiag.render.rules import FOR_DEFAULTS, INTERVAL, Links, for_durations

EXIT_STALE = 1
EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("render")
    p.add_argument("--out", default=".", metavar="DIR", help="repository root to write under (default: .)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 listing stale or missing files")
    p.add_argument("--config", metavar="FILE", help="YAML with a checks: section (thresholds, window, SLO)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a threshold")
    p.add_argument("--runbook-base-url", default=Links.runbook_base, help="runbook_url prefix (default: %(default)s)")
    p.add_argument("--grafana-url", default=Links.grafana_base, help="dashboard_url prefix, e.g. https://grafana.example.org")
    p.add_argument("--grafana-datasource-uid", default=DATASOURCE_UID,
                   help="uid of the Prometheus data source the Grafana-managed alerts query (default: %(default)s)")
    p.add_argument("--for", dest="for_", action="append", default=[], metavar="KEY=DURATION",
                   help="how long an alert's condition must hold before it fires, by severity or for the metrics-absent "
                        "guard (repeatable; defaults: " + ", ".join(f"{k}={v}" for k, v in FOR_DEFAULTS.items()) + ")")
    p.add_argument("--interval", default=f"{INTERVAL:g}s", metavar="DURATION",
                   help="every rule group's evaluation interval: the engines' scrape interval (default: %(default)s)")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        config = resolve(args.config, args.set)
        for_by = for_durations(args.for_)
        interval = parse_duration(args.interval)
        if interval <= 0:
            raise ValueError(f"--interval {args.interval!r}: the interval must be positive")
        files = render_all(config, Links(args.runbook_base_url, args.grafana_url), datasource_uid=args.grafana_datasource_uid,
                           for_by=for_by, interval=interval)
    except ValueError as exc:  # a ConfigError is one too; so is an interval the window cannot hold
        print(f"kvdiag render: {exc}", file=sys.stderr)
        return EXIT_ERROR
    root = Path(args.out)
    if args.check:
        stale = [p for p, text in files.items() if not (root / p).exists() or (root / p).read_text(encoding="utf-8") != text]
        for p in stale:
            print(f"stale: {p}", file=sys.stderr)
        if stale:
            print("kvdiag render: generated files are out of date; run `make generate` (kvdiag render)", file=sys.stderr)
            return EXIT_STALE
        return 0
    for p, text in files.items():
        path = root / p
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {p}", file=sys.stderr)
    return 0
