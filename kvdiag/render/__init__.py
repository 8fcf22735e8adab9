"""The monitoring mixin: rules, alerts, dashboards, runbooks, the Kubernetes PrometheusRule and
the keep-list of the families the rules read, rendered from the checklist.

``render_all`` returns every generated file (repository-relative path -> text); ``kvdiag
render`` writes them and ``kvdiag render --check`` compares them with the committed ones.
"""

from __future__ import annotations

from typing import Mapping

from kvdiag.config import Config
from kvdiag.render import dashboards, grafana_alerts, keep, kubernetes, rules, runbooks
from kvdiag.render.promql import Labels

RULES_RECORDING = "rules/kvdiag-recording.yaml"
RULES_ALERTS = "rules/kvdiag-alerts.yaml"
GRAFANA_ALERTS = "deploy/grafana/provisioning/alerting/kvdiag-alerts.yaml"
RUNBOOKS = "docs/runbooks.md"
PROMETHEUS_RULE = "deploy/kubernetes/prometheusrule.yaml"
#: Not under rules/*.yaml, which Prometheus loads as rule files.
KEEP_LIST = "rules/keep/metric-relabel-configs.yaml"


def render_all(
    config: Config = Config(),
    links: rules.Links = rules.Links(),
    lbl: Labels = Labels(),
    datasource_uid: str = grafana_alerts.DATASOURCE_UID,
    for_by: Mapping[str, str] = rules.FOR_DEFAULTS,
    interval: float = rules.INTERVAL,
) -> dict[str, str]:
    """``for_by``: each alert's ``for:`` by severity and ``absent`` (``rules.for_durations``);
    ``interval``: every rule group's evaluation interval in seconds (the scrape interval)."""
    files = {
        RULES_RECORDING: rules.recording_file(config, lbl, interval),
        RULES_ALERTS: rules.alert_file(config, links, lbl, for_by, interval),
        GRAFANA_ALERTS: grafana_alerts.provisioning_file(config, links, lbl, datasource_uid, for_by),
        RUNBOOKS: runbooks.render(config, for_by),
    }
    files[PROMETHEUS_RULE] = kubernetes.prometheus_rule(files[RULES_RECORDING], files[RULES_ALERTS])
    files[KEEP_LIST] = keep.keep_file(files[RULES_RECORDING])
    for stem, d in dashboards.dashboards(config, lbl).items():
        files[f"dashboards/{stem}.json"] = dashboards.to_json(d, lbl)
    return files
