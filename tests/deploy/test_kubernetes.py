"""deploy/kubernetes/: valid YAML of the right kinds, wired together, and the PrometheusRule
holding exactly the rule groups of rules/ (its freshness is test_render's staleness check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvdiag.cli import build_parser
from kvdiag.render import PROMETHEUS_RULE, RULES_ALERTS, RULES_RECORDING
from kvdiag.render.rules import groups as rule_groups
from kvdiag.server import settings
from tests.mixin.conftest import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
API_VERSIONS = {
    "ConfigMap": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PodMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
}


def _docs() -> list[dict]:
    docs = [d for p in sorted(KUBE.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d is not None]
    assert docs, f"no manifests under {KUBE}"
    return docs


def _one(kind: str, name: str = "kvdiag") -> dict:
    (doc,) = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_every_manifest_is_a_known_kind_with_its_api_version() -> None:
    docs = _docs()
    for d in docs:
        assert API_VERSIONS.get(d["kind"]) == d["apiVersion"], (d["kind"], d["apiVersion"])
        assert d["metadata"]["name"] and "namespace" not in d["metadata"]  # kubectl -n chooses
    assert {d["kind"] for d in docs} == set(API_VERSIONS)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names))


def test_the_prometheus_rule_holds_the_groups_of_rules() -> None:
    rule = yaml.safe_load((ROOT / PROMETHEUS_RULE).read_text())
    groups = [g for p in (RULES_RECORDING, RULES_ALERTS) for g in yaml.safe_load((ROOT / p).read_text())["groups"]]
    assert rule["spec"]["groups"] == groups
    assert [g["name"] for g in groups] == rule_groups()


def test_the_deployment_runs_serve_on_its_config_map(tmp_path: Path) -> None:
    deploy, service, config_map = _one("Deployment"), _one("Service"), _one("ConfigMap")
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve"
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.listen == f"0.0.0.0:{port_names['http-metrics']}"
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http-metrics"]
    # --config is a key of the ConfigMap, mounted where the volume says
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    key = Path(args.config).relative_to(mount["mountPath"]).as_posix()
    (tmp_path / key).write_text(config_map["data"][key])
    assert settings.load(tmp_path / key).targets  # the exporter accepts it, and it scrapes something


@pytest.mark.parametrize("kind,endpoints", [("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")])
def test_monitors_select_kvdiag_and_the_engines(kind: str, endpoints: str) -> None:
    pod_labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _one("Service")
    kvdiag = _one(kind)
    assert kvdiag["spec"]["selector"]["matchLabels"].items() <= (service["metadata"]["labels"] if kind == "ServiceMonitor" else pod_labels).items()
    (endpoint,) = kvdiag["spec"][endpoints]
    assert endpoint["port"] == "http-metrics" and endpoint["honorLabels"] is True  # keep the engines' instance
    engines = _one(kind, "llm-engines")
    (expr,) = engines["spec"]["selector"]["matchExpressions"]
    assert expr["operator"] == "In" and set(expr["values"]) == {"sglang", "vllm"}
    assert [e["path"] for e in engines["spec"][endpoints]] == ["/metrics"]
