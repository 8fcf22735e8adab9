"""The monitoring mixin: rules, alerts, dashboards and runbooks rendered from the checklist.

``render_all`` returns every generated file (repository-relative path -> text); ``kvdiag
render`` writes them and ``kvdiag render --check`` compares them with the committed ones.
"""

from __future__ import annotations

from kvdiag.config import Config
from kvdiag.render import dashboards, grafana_alerts, rules, runbooks
from kvdiag.render.promql import Labels

RULES_RECORDING = "rules/kvdiag-recording.yaml"
RULES_ALERTS = "rules/kvdiag-alerts.yaml"
GRAFANA_ALERTS = "deploy/grafana/provisioning/alerting/kvdiag-alerts.yaml"
RUNBOOKS = "docs/runbooks.md"


def render_all(
    config: Config = Config(),
    links: rules.Links = rules.Links(),
    lbl: Labels = Labels(),
    datasource_uid: str = grafana_alerts.DATASOURCE_UID,
) -> dict[str, str]:
    files = {
        RULES_RECORDING: rules.recording_file(config, lbl),
        RULES_ALERTS: rules.alert_file(config, links, lbl),
        GRAFANA_ALERTS: grafana_alerts.provisioning_file(config, links, lbl, datasource_uid),
        RUNBOOKS: runbooks.render(config),
    }
    for stem, d in dashboards.dashboards(config, lbl).items():
        files[f"dashboards/{stem}.json"] = dashboards.to_json(d, lbl)
    return files
