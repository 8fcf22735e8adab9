"""``deploy/kubernetes/prometheusrule.yaml``: the rules of ``rules/`` as a PrometheusRule.

Clusters run by the Prometheus Operator load rules from PrometheusRule objects, not files. The
object is built from the rendered rule files themselves (their groups, in order, unchanged), so
it can never say something ``rules/`` does not, and ``kvdiag render --check`` catches it stale.
"""

from __future__ import annotations

import yaml

from kvdiag.render.rules import HEADER, dump

NAME = "kvdiag"
LABELS = {"app.kubernetes.io/name": "kvdiag", "app.kubernetes.io/component": "rules"}
USAGE = (
    "# The recording and alerting rules of rules/ for the Prometheus Operator (kubectl apply -n monitoring -f ...).\n"
    "# Add the label your Prometheus' ruleSelector matches (kube-prometheus-stack: release: <helm release>).\n"
)


def prometheus_rule(*rule_files: str) -> str:
    """One PrometheusRule (monitoring.coreos.com/v1) holding every group of ``rule_files`` (the
    text of Prometheus rule files), in order."""
    groups = [g for text in rule_files for g in yaml.safe_load(text)["groups"]]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": NAME, "labels": dict(LABELS)},
        "spec": {"groups": groups},
    }
    return HEADER + USAGE + dump(doc)
