"""The same alerts as Grafana-managed alert rules (file provisioning, Grafana >= 10).

For teams that alert from Grafana rather than Prometheus/Alertmanager. Each rule runs the
alert's PromQL as an instant query against the Prometheus data source (which must hold the
recording rules of ``rules/``), reduces each series to its last value and fires where one is
present: the PromQL already returns only the instances the alert is about. Grafana templates
cannot run queries, so the description carries the instance and the meaning, and the values
are one click away on the linked dashboard.
"""

from __future__ import annotations

from typing import Mapping

from kvdiag.config import Config
from kvdiag.render.promql import Labels
from kvdiag.render.rules import FOR_DEFAULTS, HEADER, Alert, Links, alerts, dashboard_url, dump, runbook_url

FOLDER = "kvdiag"
GROUP = "kvdiag"
#: The uid the provisioned Prometheus data source must have (docker-compose provisions it).
DATASOURCE_UID = "prometheus"


def _uid(alert: Alert) -> str:
    return "kvdiag-" + alert.source.replace("_", "-")


def _rule(a: Alert, config: Config, links: Links, lbl: Labels, datasource_uid: str) -> dict:
    where = "{{ $labels." + lbl.target[-1] + " }}" + "".join(
        f"{{{{ with $labels.{s} }}}} {s} {{{{ . }}}}{{{{ end }}}}" for s in lbl.split
    )
    lookback = max(600, 2 * int(config.window))
    return {
        "uid": _uid(a),
        "title": a.name,
        "condition": "C",
        "data": [
            {
                "refId": "A",
                "relativeTimeRange": {"from": lookback, "to": 0},
                "datasourceUid": datasource_uid,
                "model": {"refId": "A", "expr": f"count without () ({a.expr})", "instant": True, "range": False,
                          "intervalMs": 1000, "maxDataPoints": 43200},
            },
            {
                "refId": "B",
                "datasourceUid": "__expr__",
                "model": {"refId": "B", "type": "reduce", "expression": "A", "reducer": "last", "settings": {"mode": "dropNN"}},
            },
            {
                "refId": "C",
                "datasourceUid": "__expr__",
                "model": {"refId": "C", "type": "threshold", "expression": "B",
                          "conditions": [{"evaluator": {"type": "gt", "params": [0]}}]},
            },
        ],
        "noDataState": "OK",
        "execErrState": "Error",
        "for": a.for_,
        "labels": {"severity": a.severity},
        "annotations": {
            "summary": a.summary,
            "description": f"{where}: {a.meaning}.",
            "runbook_url": runbook_url(a, links),
            "dashboard_url": dashboard_url(links, lbl, template="grafana"),
        },
        "isPaused": False,
    }


def provisioning_file(
    config: Config,
    links: Links = Links(),
    lbl: Labels = Labels(),
    datasource_uid: str = DATASOURCE_UID,
    for_by: Mapping[str, str] = FOR_DEFAULTS,
) -> str:
    group = {
        "orgId": 1,
        "name": GROUP,
        "folder": FOLDER,
        "interval": "1m",
        "rules": [_rule(a, config, links, lbl, datasource_uid) for a in alerts(config, lbl, for_by)],
    }
    return HEADER + dump({"apiVersion": 1, "groups": [group]})
