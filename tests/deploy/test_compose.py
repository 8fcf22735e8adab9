"""docker-compose.yml, the Dockerfile and the Grafana provisioning, checked without a container
engine: ``docker-compose config`` (Debian's docker-compose) validates the file, and what the
native stack test cannot run (the image, Grafana) is checked as files against what uses it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from kvdiag.cli import build_parser
from kvdiag.render import GRAFANA_ALERTS
from kvdiag.render.grafana_alerts import DATASOURCE_UID
from kvdiag.server import settings
from tests.deploy import stack
from tests.mixin.conftest import ROOT, need

GRAFANA = "/etc/grafana/provisioning"


def test_docker_compose_config_validates_the_file() -> None:
    proc = subprocess.run([need("docker-compose"), "-f", str(stack.COMPOSE), "config"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert set(resolved["services"]) == {"sglang-sim", "vllm-sim", "kvdiag", "prometheus", "alertmanager", "grafana"}
    for name in ("sglang-sim", "vllm-sim", "kvdiag"):  # the anchor's build and restart reached each
        assert resolved["services"][name]["build"]["context"] == str(ROOT)
        assert resolved["services"][name]["restart"] == "unless-stopped"


def test_every_mount_exists_and_images_are_pinned() -> None:
    doc = stack.load()
    for name, svc in stack.services(doc).items():
        for target, source in svc.binds.items():
            assert source.exists() and source.is_relative_to(ROOT), (name, target, source)
        if svc.image:
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", svc.image), f"{name}: pin the image ({svc.image})"


def test_kvdiag_commands_parse_and_the_exporter_config_loads() -> None:
    services = stack.services()
    parser = build_parser()
    for name in ("sglang-sim", "vllm-sim"):
        args = parser.parse_args(list(services[name].command))
        assert (args.command, args.engine, args.scenario, args.port) == ("simulate", name.split("-")[0], "l1-saturation", services[name].port)
        assert args.host == "0.0.0.0"
    serve = services["kvdiag"]
    args = parser.parse_args(list(serve.command))
    assert args.command == "serve" and args.listen == f"0.0.0.0:{serve.port}"
    config = settings.load(serve.binds[args.config])
    urls = {t.url for t in config.targets}
    assert urls == {f"http://{n}:{services[n].port}" for n in ("sglang-sim", "vllm-sim")}


def test_prometheus_scrapes_every_kvdiag_service_and_loads_the_rules() -> None:
    services = stack.services()
    prom = services["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in prom.command if a.startswith("--config.file="))
    config = yaml.safe_load(prom.binds[config_path].read_text())
    scraped = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert scraped == {f"{n}:{services[n].port}" for n in ("sglang-sim", "vllm-sim", "kvdiag")}
    (rule_glob,) = config["rule_files"]
    rules_dir = Path(rule_glob).parent.as_posix()
    assert prom.binds[rules_dir] == ROOT / "rules" and rule_glob.endswith("*.yaml")
    (am,) = [t for a in config["alerting"]["alertmanagers"] for sc in a["static_configs"] for t in sc["targets"]]
    assert am == f"alertmanager:{services['alertmanager'].port}"


def test_grafana_provisions_the_datasource_dashboards_and_alerts() -> None:
    doc = stack.load()
    grafana = stack.services(doc)["grafana"]
    (ds,) = yaml.safe_load(grafana.binds[f"{GRAFANA}/datasources"].joinpath("prometheus.yaml").read_text())["datasources"]
    assert ds["uid"] == DATASOURCE_UID and ds["type"] == "prometheus"
    assert ds["url"] == f"http://prometheus:{stack.services(doc)['prometheus'].port}"
    (provider,) = yaml.safe_load(grafana.binds[f"{GRAFANA}/dashboards"].joinpath("kvdiag.yaml").read_text())["providers"]
    dashboards = grafana.binds[provider["options"]["path"]]
    assert dashboards == ROOT / "dashboards" and list(dashboards.glob("*.json"))
    assert grafana.binds[f"{GRAFANA}/alerting"] == (ROOT / GRAFANA_ALERTS).parent
    env = doc["services"]["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert json.loads((dashboards / home.relative_to(provider["options"]["path"])).read_text())["title"]


def test_the_image_runs_kvdiag_as_a_non_root_user() -> None:
    lines = [line.split(None, 1) for line in (ROOT / "Dockerfile").read_text().splitlines() if line and not line.startswith("#")]
    instructions = {words[0]: words[1] for words in lines if len(words) == 2}
    assert json.loads(instructions["ENTRYPOINT"]) == ["kvdiag"]
    assert instructions["USER"] not in ("root", "0")
    assert instructions["FROM"].startswith("python:") and "slim" in instructions["FROM"]
    assert int(instructions["EXPOSE"]) == stack.services()["kvdiag"].port
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignore[:1] == ["*"] and {"!pyproject.toml", "!README.md", "!kvdiag/"} <= set(ignore)
