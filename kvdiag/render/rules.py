"""Prometheus recording and alerting rules, rendered from the checklist's catalog.

Five rule groups, one per layer, each with an explicit ``interval:`` (Prometheus runs every
group on its own clock, concurrently; ``promtool test rules`` evaluates them in ``GROUPS``
order at each step):

1.-3. ``kvdiag-instance``, ``kvdiag-rates``, ``kvdiag-usage``: engine series to
   ``instance:kvdiag_*`` (``kvdiag.render.normalize``, the PromQL twin of the engine adapters,
   layered: instant figures first, windows over recorded series after);
4. ``kvdiag-checks``: ``instance:kvdiag_check:status{check}`` per catalog check, 1 firing, 0 ok,
   absent when unknown (the same contract as the exporter's ``kvdiag_check_status``). The
   condition is the catalog's own PromQL (``check_expr``: windows over recorded series);
   "known" means the check's primary input series exists for the instance and, for a check
   about growth, that the instance's series reach back far enough in time (``enough``); last,
   the decision's three statuses as one number per instance (``PATTERN``);
5. ``kvdiag-alerts``: one alert per catalog verdict and finding that names an alert. A verdict
   fires for the status patterns (firing / ok / unknown per signal) that the Python decision
   (``kvdiag.checks.verdict.decide``) maps to it, compared as ``PATTERN`` values, so Prometheus and the CLI agree even when a
   signal is unknown; the ``unknown`` verdict is every other pattern, plus ``absent()`` of all
   engine metrics. Every alert is suppressed on an instance that is idle right now (nobody
   running or waiting), so an idle engine never alerts. An alert's value is its figure (the
   KV usage admission counts, or P99 TTFT), so annotations need no query of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Iterable, Mapping

import yaml

from kvdiag.checks.catalog import CHECKS, DECISION_TABLE, FINDINGS, SERIES, SIGNALS, VERDICTS, check_expr
from kvdiag.checks.verdict import decide
from kvdiag.config import Config, parse_duration, prom_duration
from kvdiag.model import CheckResult, Evidence
from kvdiag.render.dashboards import INSTANCE_SLUG, INSTANCE_UID
from kvdiag.render.normalize import Recording, layers, series_name
from kvdiag.render.promql import CHECK_STATUS, INSTANCE_INFO, Labels

#: The rule groups in evaluation order (the normalization's layers, the checks, the alerts).
CHECKS_GROUP, ALERTS_GROUP = "kvdiag-checks", "kvdiag-alerts"
#: How often every group is evaluated unless ``kvdiag render --interval`` says otherwise: the
#: scrape interval most fleets run, which the rules should match (a recorded series samples
#: each scrape once).
INTERVAL = 15.0


def groups() -> list[str]:
    """Every group's name, in layer order (what ``promtool test rules`` evaluates in turn)."""
    return [name for name, _ in layers(Config())] + [CHECKS_GROUP, ALERTS_GROUP]


#: ``for:`` by severity: a page waits less than a ticket, a troubleshooting note waits longest.
FOR_BY_SEVERITY = {"critical": "2m", "warning": "5m", "info": "10m"}
#: The absent()-style guard waits longer: a target that restarts is briefly without series.
ABSENT_FOR = "10m"
#: Every ``for:`` the alerts use, keyed by severity and ``absent`` (the guard above): what
#: ``kvdiag render --for KEY=DURATION`` overrides.
FOR_DEFAULTS = {**FOR_BY_SEVERITY, "absent": ABSENT_FOR}


def for_durations(overrides: Iterable[str]) -> dict[str, str]:
    """``FOR_DEFAULTS`` with ``KEY=DURATION`` overrides applied (``critical=5m``, ``absent=1h``).

    Teams page on different clocks, and tests on a real Prometheus cannot wait minutes for an
    alert to leave ``pending``; the defaults stay what the committed files hold. A bare number is
    seconds; every duration is written back as a Prometheus literal (``90`` -> ``90s``, ``120s``
    -> ``2m``). ValueError names a bad key or duration."""
    out = dict(FOR_DEFAULTS)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or key not in FOR_DEFAULTS:
            raise ValueError(f"--for {item!r}: expected KEY=DURATION with KEY one of {', '.join(FOR_DEFAULTS)}")
        seconds = parse_duration(raw)
        if seconds <= 0:
            raise ValueError(f"--for {item!r}: the duration must be positive")
        out[key] = prom_duration(seconds)
    return out


@dataclass(frozen=True)
class Links:
    """Where alerts point. Defaults are repository-relative: no host name is baked in."""

    runbook_base: str = "docs/runbooks.md"
    grafana_base: str = ""  # e.g. https://grafana.example.org; empty = relative to Grafana


@dataclass(frozen=True)
class Alert:
    """One alert, rendered both as a Prometheus alerting rule and a Grafana-managed rule."""

    name: str
    severity: str
    expr: str
    for_: str
    summary: str
    meaning: str  # the decision-table rows (or finding) it stands for, for the description
    values: tuple[tuple[str, str, str], ...]  # (label, series, Go template format pipeline): what the runbook reads
    value: tuple[str, str] | None  # (label, Go template pipeline) of the alert's own value, None: no figure
    kind: str  # "verdict" | "finding" | "absent"
    source: str  # catalog verdict or finding name
    remedies: tuple[str, ...] = field(default_factory=tuple)

    def anchor(self) -> str:
        """The runbook section anchor (GitHub slug of the heading, which is the alert name)."""
        return self.name.lower()


def _series(name: str, config: Config) -> str:
    return series_name(SERIES[name].name, config)


def primary_series(check: str, config: Config) -> str:
    """The series whose presence makes a check known: the first of its inputs that the
    catalog records (the check's main figure: usage, waiting, evictions, TTFT, ...)."""
    spec = next(c for c in CHECKS if c.name == check)
    for f in spec.needs:
        for s in SERIES.values():
            if s.field == f:
                return series_name(s.name, config)
    raise ValueError(f"check {check} reads no recorded series")


def _on(lbl: Labels) -> str:
    return "on (" + ", ".join(lbl.key) + ")"


def enough(config: Config, interval: float) -> str:
    """Where the window holds ``min_samples`` scrapes (as the Python check says "needs a
    window"), counted in time rather than in points: the instance's queue series was recorded
    at least (min_samples - 1) evaluation intervals back inside the window. A slow or skipped
    evaluation leaves fewer points, never a shorter history, so it cannot read as unknown."""
    back = max(config.min_samples - 1, 0) * interval
    if back >= config.window:
        raise ValueError(f"min_samples {config.min_samples:g} at a {interval:g}s interval do not fit in the {config.window:g}s window")
    waiting = _series("instance:kvdiag_waiting:requests", config)
    if back == 0:
        return waiting
    return f"present_over_time({waiting}[{prom_duration(config.window - back)}] offset {prom_duration(back)})"


def check_rules(config: Config, lbl: Labels, interval: float = INTERVAL) -> list[Recording]:
    """A check is known where its primary series exists and, for a check about growth, where the
    instance's series reach back far enough (``enough``)."""
    out = []
    for spec in CHECKS:
        primary = f"({spec.known.format(**config.promql_params())})" if spec.known else primary_series(spec.name, config)
        known = f"{INSTANCE_INFO} and {_on(lbl)} {primary}"
        if spec.growth:
            known = f"({known}) and {_on(lbl)} {enough(config, interval)}"
        firing = f"({known} and {_on(lbl)} ({check_expr(spec.name, config)})) * 0 + 1"
        expr = f"({firing}) or ({known}) * 0"
        out.append(Recording(CHECK_STATUS, expr, f"{spec.name}: {spec.title} (1 firing, 0 ok, absent unknown)", (("check", spec.name),)))
    return out


#: The decision's signals as one number per instance, recorded after the checks: the sum over
#: the signals (in ``SIGNALS`` order) of 3^i x their state's digit. The alerts compare this one
#: series with a verdict's patterns, instead of joining three status series per pattern (at
#: 10,000 instances the joins made the alert group the costliest of all).
PATTERN = "instance:kvdiag_check:pattern"
DIGIT = {"ok": 0, "firing": 1, "unknown": 2}


def pattern_rule(lbl: Labels) -> Recording:
    """``PATTERN`` for every instance: a status where the check is known, 2 (unknown) where not."""
    terms = [f'{3 ** i} * ({CHECK_STATUS}{{check="{c}"}} or {_on(lbl)} {INSTANCE_INFO} * 0 + {DIGIT["unknown"]})'
             for i, c in enumerate(SIGNALS.values())]
    expr = f" + {_on(lbl)} ".join(f"({t})" for t in terms)
    return Recording(PATTERN, expr, "the statuses of " + ", ".join(SIGNALS.values())
                     + " as one number: the sum of 3^i x (0 ok, 1 firing, 2 unknown), in that order")


def pattern_code(pattern: tuple[str, ...]) -> int:
    """The value ``PATTERN`` takes for a (S, Q, E) status pattern."""
    return sum(3 ** i * DIGIT[state] for i, state in enumerate(pattern))


def _status(check: str, state: str, lbl: Labels) -> str:
    """A finding's condition on one check: ``state`` is firing or ok."""
    return f"and {_on(lbl)} {CHECK_STATUS}{{check=\"{check}\"}} == {DIGIT[state]}"


def _decided(pattern: tuple[str, ...], config: Config) -> str:
    """The Python verdict for a (S, Q, E) status pattern, via the decision code itself."""
    ev = Evidence(0.0, 0.0, 0)
    checks = {name: CheckResult(name, st, ev) for name, st in zip(SIGNALS.values(), pattern)}  # type: ignore[arg-type]
    return decide(checks, config).name


def _patterns(verdict: str, config: Config) -> list[tuple[str, ...]]:
    states = ("firing", "ok", "unknown")
    return [p for p in product(states, repeat=len(SIGNALS)) if _decided(p, config) == verdict]


def _among(patterns: list[tuple[str, ...]]) -> str:
    """The instances whose recorded pattern is one of ``patterns``, in one pass over the series:
    bit ``PATTERN`` of a mask that holds one bit per pattern (3^3 = 27 bits, exact in a float),
    rather than one comparison per pattern (15 for ``KvdiagEngineMetricsAbsent``)."""
    mask = sum({2 ** pattern_code(p) for p in patterns})
    return f"(floor({mask} / 2 ^ {PATTERN}) % 2 == 1)"


def _figure(series: str, lbl: Labels) -> str:
    """Every instance, valued by ``series`` where it has one and NaN where not: the left side of
    an alert's expression, whose value the alert carries (``and`` / ``unless`` keep it)."""
    return f"({series} or on ({', '.join(lbl.key)}) {INSTANCE_INFO} * NaN)"


def _not_idle(expr: str, config: Config, lbl: Labels) -> str:
    idle = f"({_series('instance:kvdiag_running:requests', config)} + {_series('instance:kvdiag_waiting:requests', config)}) == 0"
    return f"({expr}) unless {_on(lbl)} ({idle})"


#: What alert descriptions show, in order: catalog series -> (label, Go template formatting).
DESCRIBED = {
    "instance:kvdiag_kv_usage:ratio": ("KV usage", "humanizePercentage"),
    "instance:kvdiag_waiting:requests": ("waiting", 'printf "%.0f"'),
    "instance:kvdiag_running:requests": ("running", 'printf "%.0f"'),
    "instance:kvdiag_evictions:rate{window}": ("evictions", 'printf "%.3f/s"'),
    "instance:kvdiag_ttft_seconds:p99_{window}": ("P{quantile} TTFT", 'printf "%.2fs"'),
    "instance:kvdiag_prefix_hit:ratio{window}": ("prefix hit ratio", "humanizePercentage"),
}
#: What an alert's value is: a verdict's, the KV usage admission counts; a finding's, the TTFT quantile.
ADMISSION_USAGE, TTFT = "instance:kvdiag_kv_admission_usage:ratio{window}", "instance:kvdiag_ttft_seconds:p99_{window}"
CAPACITY_VALUES = tuple(DESCRIBED)[:4]  # the pool and the queue
LATENCY_VALUES = tuple(DESCRIBED)[4:]  # TTFT beside the hit ratio


def _values(config: Config, names: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    quantile = f"{config.ttft_quantile * 100:g}"
    return tuple((DESCRIBED[n][0].format(quantile=quantile), _series(n, config), DESCRIBED[n][1]) for n in names)


def alerts(config: Config, lbl: Labels = Labels(), for_by: Mapping[str, str] = FOR_DEFAULTS) -> list[Alert]:
    """Every alert the catalog names, in catalog order (verdicts, then findings); ``for_by``
    gives each ``for:`` by severity and ``absent`` (see ``for_durations``)."""
    out = []
    for v in VERDICTS.values():
        if v.alert is None:
            continue
        if v.name == "unknown":
            decided = _among([p for name in VERDICTS if name != "unknown" for p in _patterns(name, config)])
            expr = f"({_not_idle(f'{INSTANCE_INFO} unless {_on(lbl)} {decided}', config, lbl)}) or absent({INSTANCE_INFO})"
            meaning = (
                "a signal the decision table needs is not reported, and the answer depends on it "
                "(or no engine reports scheduler metrics at all)"
            )
            out.append(Alert(v.alert, v.severity, expr, for_by["absent"], v.summary, meaning, _values(config, CAPACITY_VALUES),
                             None, "absent", v.name, v.remedies))
            continue
        meaning = "; or ".join(r.meaning for r in DECISION_TABLE if r.verdict == v.name)
        expr = f"{_figure(_series(ADMISSION_USAGE, config), lbl)} and {_on(lbl)} {_among(_patterns(v.name, config))}"
        out.append(Alert(v.alert, v.severity, _not_idle(expr, config, lbl), for_by[v.severity],
                         v.summary, meaning, _values(config, tuple(DESCRIBED)), ("KV usage with the next admission's need", "humanizePercentage"),
                         "verdict", v.name, v.remedies))
    for f in FINDINGS.values():
        if f.alert is None:
            continue
        parts = [_figure(_series(TTFT, config), lbl)] + [_status(c, "firing", lbl) for c in f.all_of] + [_status(c, "ok", lbl) for c in f.none_of]
        if f.verdicts:
            parts.append(f"and {_on(lbl)} " + _among([p for v in f.verdicts for p in _patterns(v, config)]))
        titles = {c.name: c.title for c in CHECKS}
        meaning = " and ".join(titles[c] for c in f.all_of) + "".join(f", not {titles[c]}" for c in f.none_of)
        out.append(Alert(f.alert, f.severity, _not_idle(" ".join(parts), config, lbl), for_by[f.severity],
                         f.summary, meaning, _values(config, LATENCY_VALUES), (f"P{config.ttft_quantile * 100:g} TTFT", 'printf "%.2fs"'),
                         "finding", f.name, f.remedies))
    return out


# --- Templates ------------------------------------------------------------------------------


def _where(lbl: Labels) -> str:
    """Go template text naming the instance: target, model and DP engine where present."""
    parts = [f"{{{{ $labels.{lbl.target[-1]} }}}}"]
    parts += [f"{{{{ with $labels.{s} }}}} {s} {{{{ . }}}}{{{{ end }}}}" for s in lbl.split]
    parts.append(f"{{{{ with $labels.{lbl.model} }}}} ({{{{ . }}}}){{{{ end }}}}")
    return "".join(parts)


def description(alert: Alert, lbl: Labels) -> str:
    """The instance (the alert's labels), what the alert means and its figure (its value): no
    query per alert, so a fleet with thousands of alerts costs nothing to annotate."""
    now = f" Now: {alert.value[0]} {{{{ $value | {alert.value[1]} }}}}." if alert.value else ""
    return f"{_where(lbl)}: {alert.meaning}.{now}"


def runbook_url(alert: Alert, links: Links) -> str:
    return f"{links.runbook_base}#{alert.anchor()}"


def dashboard_url(links: Links, lbl: Labels, template: str = "prometheus") -> str:
    """The instance dashboard for the alert's instance (Prometheus or Grafana template syntax)."""
    if template == "prometheus":
        vars_ = "&".join(f"var-{k}={{{{ $labels.{k} | urlquery }}}}" for k in lbl.target)
    else:
        vars_ = "&".join(f"var-{k}={{{{ index $labels \"{k}\" }}}}" for k in lbl.target)
    return f"{links.grafana_base}/d/{INSTANCE_UID}/{INSTANCE_SLUG}?{vars_}"


# --- YAML -----------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Long PromQL as literal blocks; everything else plain."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def dump(data: object) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100_000, allow_unicode=True)


HEADER = "# Generated by `kvdiag render` from kvdiag/checks/catalog.py and kvdiag/config.py; do not edit.\n"


def recording_file(config: Config, lbl: Labels = Labels(), interval: float = INTERVAL) -> str:
    rule_groups = layers(config, lbl) + [(CHECKS_GROUP, check_rules(config, lbl, interval) + [pattern_rule(lbl)])]
    text = HEADER
    text += "# Recording rules: engine series (sglang:*, sglang_*, vllm:*, vllm_*) to instance:kvdiag_* series,\n"
    text += "# one per data-parallel engine (" + ", ".join(lbl.key) + "), then the checklist's checks. One group per\n"
    text += "# layer: the first reads engine series at one instant, later ones take windows over recorded series.\n"
    text += "groups:\n"
    for name, rules in rule_groups:
        text += f"- name: {name}\n  interval: {prom_duration(interval)}\n  rules:\n"
        for r in rules:
            text += f"  # {r.meaning}\n" + _indent(dump([_recording(r)]), "  ")
    return text


def _indent(text: str, prefix: str) -> str:
    return "".join(prefix + line if line.strip() else line for line in text.splitlines(keepends=True))


def _recording(r: Recording) -> dict:
    out: dict = {"record": r.record, "expr": r.expr}
    if r.labels:
        out["labels"] = dict(r.labels)
    return out


def alert_file(config: Config, links: Links = Links(), lbl: Labels = Labels(), for_by: Mapping[str, str] = FOR_DEFAULTS,
               interval: float = INTERVAL) -> str:
    rules = []
    for a in alerts(config, lbl, for_by):
        rules.append({
            "alert": a.name,
            "expr": a.expr,
            "for": a.for_,
            "labels": {"severity": a.severity},
            "annotations": {
                "summary": a.summary,
                "description": description(a, lbl),
                "runbook_url": runbook_url(a, links),
                "dashboard_url": dashboard_url(links, lbl),
            },
        })
    return HEADER + dump({"groups": [{"name": ALERTS_GROUP, "interval": prom_duration(interval), "rules": rules}]})
