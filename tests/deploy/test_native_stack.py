"""docker-compose.yml's stack, run natively: the alert fires in Prometheus and reaches Alertmanager.

No container engine runs here, so the services run as processes on loopback with the compose
file's own commands and configuration files (deploy/prometheus/prometheus.yml,
deploy/alertmanager/alertmanager.yml, deploy/kvdiag/kvdiag.yaml): the two simulated engines and
the exporter (``kvdiag simulate`` / ``kvdiag serve``) and Debian's Prometheus and Alertmanager.
What is substituted is listed in tests/deploy/stack.py (addresses and ports to loopback,
container paths to the mounted files, images to binaries); on top of it this test changes two
things, both to fit CI's time:

- the rules: ``./rules`` is replaced by rules rendered into a temporary folder with
  ``kvdiag render --interval 5s --for critical=5s --for warning=5s --for info=5s --for absent=5s``,
  the same rules evaluated at the stack's 5 s scrape interval, with every ``for:`` at 5 s instead
  of 2-10 minutes;
- the simulators' ``--speed``: 10 simulated seconds per wall second instead of 4, so vLLM's
  pool saturates within seconds (the compose file's 1800 simulated seconds still outlast the test).

Then KvdiagL1KVPoolBottleneck must be firing for the vLLM engine in Prometheus
(/api/v1/alerts), and Alertmanager must hold it (/api/v2/alerts): Prometheus' scrape jobs,
rule_files path and alerting target in prometheus.yml, the alert routing in alertmanager.yml,
the exporter's targets in kvdiag.yaml, and every service's command line work together. The
exporter's own verdict for the same engine, read through Prometheus, must agree.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import requests

from kvdiag.cli import main
from kvdiag.render.rules import FOR_DEFAULTS
from tests.conftest import hang_guard
from tests.deploy import stack
from tests.mixin.prom import Process

ALERT = "KvdiagL1KVPoolBottleneck"
SHORT_FOR = "5s"
SPEED = "10"
NATIVE = ("sglang-sim", "vllm-sim", "kvdiag", "alertmanager", "prometheus")  # grafana: files only
BUDGET_S = hang_guard(25)  # from every target up to the alert firing (about 25 s on 2 idle cores)


def _get(url: str, **params: str) -> Any:
    # a query on a loaded machine can take seconds: the timeout is a hang guard, the waits retry
    r = requests.get(url, params=params, timeout=hang_guard(6))
    r.raise_for_status()
    return r.json()


def _firing(prom: str) -> list[dict]:
    alerts = _get(prom + "/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == ALERT and a["state"] == "firing"]


def _received(am: str) -> list[dict]:
    return [a for a in _get(am + "/api/v2/alerts") if a["labels"]["alertname"] == ALERT]


def _on(target: str, alerts: list[dict]) -> dict | None:
    """The alert about the engine at ``target`` (Prometheus' instance label), if any. (SGLang's
    side of the story is l1_kv_pressure: its admission reserve keeps it from retracting.)"""
    return next((a for a in alerts if a["labels"]["instance"] == target), None)


def _up_jobs(prom: str) -> set[str]:
    targets = _get(prom + "/api/v1/targets")["data"]["activeTargets"]
    return {t["labels"]["job"] for t in targets if t["health"] == "up"}


@contextlib.contextmanager
def _running(processes: list[Process]) -> Iterator[None]:
    """Start in order, stop in reverse, whatever happens; a failure shows every log."""
    started: list[Process] = []
    try:
        for p in processes:
            started.append(p)
            p.start(timeout=hang_guard(10))
        yield
    except BaseException:
        for p in started:
            print(f"--- {p.argv[:4]} ---\n{p.logs()}")
        raise
    finally:
        for p in reversed(started):
            p.stop()


def _rules(tmp: Path) -> Path:
    out = tmp / "render"
    # rules evaluated at the stack's 5 s scrape interval (deploy/prometheus/prometheus.yml)
    assert main(["render", "--out", str(out), "--interval=5s", *(f"--for={k}={SHORT_FOR}" for k in FOR_DEFAULTS)]) == 0
    return out / "rules"


def test_compose_stack_fires_the_l1_alert_into_alertmanager(tmp_path: Path) -> None:
    services = stack.services()
    assert set(services) - set(NATIVE) == {"grafana"}, "a new service: run it here too"
    chosen = {n: services[n] for n in stack.start_order({n: services[n] for n in NATIVE})}
    loop = stack.Loopback(chosen, tmp_path)
    mounts = {"prometheus": {"/etc/prometheus/rules": _rules(tmp_path)}}
    flags = {n: {"--speed": SPEED} for n, s in chosen.items() if s.command[:1] == ("simulate",)}
    assert set(flags) == {"sglang-sim", "vllm-sim"}
    processes = [loop.process(n, mounts.get(n), flags.get(n)) for n in chosen]
    prom, am = loop.url("prometheus"), loop.url("alertmanager")
    vllm_target = loop.url("vllm-sim").split("//", 1)[1]
    with _running(processes):
        Process.wait(lambda: _up_jobs(prom) == {"sglang", "vllm", "kvdiag"}, hang_guard(10), "Prometheus to scrape every job")
        firing = Process.wait(lambda: _on(vllm_target, _firing(prom)), BUDGET_S, f"{ALERT} to fire for vLLM in Prometheus")
        assert firing["labels"]["job"] == "vllm" and firing["labels"]["severity"] == "critical"
        assert firing["annotations"]["runbook_url"].endswith("#" + ALERT.lower())
        received = Process.wait(lambda: _on(vllm_target, _received(am)), hang_guard(10), f"{ALERT} to reach Alertmanager")
        assert received["status"]["state"] == "active" and received["labels"]["job"] == "vllm"
        up = _get(prom + "/api/v1/query", query='kvdiag_up{job="kvdiag"}')["data"]["result"]
        assert len(up) == 2 and all(s["value"][1] == "1" for s in up), up  # the exporter reads both engines
        l1 = 'kvdiag_verdict{job="kvdiag",engine="vllm",verdict="l1_kv_bottleneck"} == 1'
        Process.wait(lambda: _get(prom + "/api/v1/query", query=l1)["data"]["result"], hang_guard(10), "the exporter's L1 verdict for vLLM in Prometheus")
