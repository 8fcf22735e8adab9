"""``kvdiag explain``: the decision table, the checks and the thresholds in force."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from kvdiag import config as cfg
from kvdiag.checks import catalog
from kvdiag.report.json import dumps
from kvdiag.report.terminal import Fitted

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("explain")
    p.add_argument("--config", metavar="YAML", help="thresholds file (its 'checks:' section)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a threshold")
    p.add_argument("--promql", action="store_true", help="also print each check's and alert's PromQL")
    p.add_argument("--json", action="store_true", help="print the catalog and thresholds as JSON")
    p.add_argument("--yaml", action="store_true", help="print the thresholds in force as a commented config file")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        config = cfg.resolve(args.config, args.set)
    except cfg.ConfigError as exc:
        print(f"kvdiag explain: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(dumps(catalog_json(config), indent=2))
        return 0
    if args.yaml:
        print(config_yaml(config), end="")
        return 0
    console = Console()
    console.print(Fitted(decision_table()))
    console.print(Fitted(checks_table(config, args.promql)))
    console.print(Fitted(findings_table()))
    console.print(Fitted(thresholds_table(config, args.config)))
    if args.promql:
        for name, spec in catalog.VERDICTS.items():
            expr = catalog.verdict_expr(name, config)
            if expr:
                console.print(f"[bold]{spec.alert}[/bold] (verdict {name}, {spec.severity}):\n  {expr}", soft_wrap=True)
        for name, f in catalog.FINDINGS.items():
            label = f.alert or "(no alert)"
            console.print(f"[bold]{label}[/bold] (finding {name}, {f.severity}):\n  {catalog.finding_expr(name, config)}", soft_wrap=True)
    return 0


#: Columns of names and short values: drawn whole at any width (``Fitted``), never cut.
NAMES = frozenset({"S", "Q", "E", "verdict", "severity", "exit", "alert", "check", "finding", "needs a window", "key", "value", "default"})


def decision_table() -> Table:
    t = Table(title="verdict decision table (S = kv_usage_saturated, Q = queue_growing, E = evictions_growing)")
    for col in ("S", "Q", "E", "verdict", "severity", "exit", "alert", "meaning"):
        t.add_column(col, no_wrap=col in NAMES)
    mark = {True: "✔", False: "·"}
    for row in catalog.DECISION_TABLE:
        v = catalog.VERDICTS[row.verdict]
        t.add_row(mark[row.s], mark[row.q], mark[row.e], row.verdict, v.severity, str(v.exit_code), v.alert or "—", row.meaning)
    u = catalog.VERDICTS["unknown"]
    t.add_row("?", "?", "?", "unknown", u.severity, str(u.exit_code), u.alert or "—",
              "a signal is unknown and the table's answer depends on it")  # fmt: skip
    return t


def checks_table(config: cfg.Config, promql: bool) -> Table:
    t = Table(title="checks", show_lines=promql)
    for col in ("check", "signal", "fires when", "needs a window") + (("PromQL",) if promql else ()):
        t.add_column(col, no_wrap=col in NAMES)
    values = {k: v for k, v, _ in config.describe()}
    for c in catalog.CHECKS:
        row = [c.name, c.signal or "—", c.fires_when.format(**values), "yes" if c.growth else "no"]
        if promql:
            row.append(catalog.check_expr(c.name, config))
        t.add_row(*row)
    return t


def findings_table() -> Table:
    t = Table(title="findings (may accompany any verdict)")
    for col in ("finding", "severity", "alert", "when", "meaning"):
        t.add_column(col, no_wrap=col in NAMES)
    for f in catalog.FINDINGS.values():
        when = " and ".join(f.all_of)
        if f.none_of:
            when += ", not " + ", not ".join(f.none_of)
        if f.verdicts:
            when += f"; verdict {' or '.join(f.verdicts)}"
        t.add_row(f.name, f.severity, f.alert or "—", when, f.summary)
    return t


def thresholds_table(config: cfg.Config, path: str | None) -> Table:
    defaults = {k: v for k, v, _ in cfg.Config().describe()}
    t = Table(title=f"thresholds in force ({path or 'defaults'}; --set overrides)")
    for col in ("key", "value", "default", "what it does"):
        t.add_column(col, no_wrap=col in NAMES)
    for key, value, doc in config.describe():
        t.add_row(key, value, defaults[key] if defaults[key] != value else "", doc)
    return t


def config_yaml(config: cfg.Config) -> str:
    """A config file that ``--config`` reads back to the same thresholds."""
    lines = [f"{cfg.SECTION}:"]
    for key, value, doc in config.describe():
        lines += [f"  # {doc}", f"  {key}: {value}"]
    return "\n".join(lines) + "\n"


def catalog_json(config: cfg.Config) -> dict:
    """The whole catalog with the thresholds in force and the PromQL they give."""
    return {
        "thresholds": {k: v for k, v, _ in config.describe()},
        "series": {name: asdict(s) for name, s in catalog.SERIES.items()},
        "signals": catalog.SIGNALS,
        "checks": [{**asdict(c), "promql": catalog.check_expr(c.name, config)} for c in catalog.CHECKS],
        "decision_table": [asdict(r) for r in catalog.DECISION_TABLE],
        "verdicts": {n: {**asdict(v), "promql": catalog.verdict_expr(n, config)} for n, v in catalog.VERDICTS.items()},
        "findings": {n: {**asdict(f), "promql": catalog.finding_expr(n, config)} for n, f in catalog.FINDINGS.items()},
        "remedies": {n: asdict(r) for n, r in catalog.REMEDIES.items()},
    }
