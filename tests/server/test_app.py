"""The HTTP surface against simulated engines on loopback: verdicts reach /metrics and the
API, /metrics passes promtool, the API takes its token, /probe keeps to its allowlist."""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse
from typing import Callable

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.checks.catalog import VERDICTS
from kvdiag.refpool.serve import MetricsServer
from kvdiag.server.app import create_app
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.probe import Allowlist
from kvdiag.server.settings import ProbeSettings, Settings
from tests.server.conftest import settings_for, wait_for

FAMILIES = {
    "kvdiag_up", "kvdiag_scrape_duration_seconds", "kvdiag_kv_pool_tokens", "kvdiag_kv_usage_ratio",
    "kvdiag_kv_admission_usage_ratio", "kvdiag_kv_capacity_tokens", "kvdiag_waiting_requests", "kvdiag_running_requests", "kvdiag_evictions",
    "kvdiag_prefix_hit_ratio", "kvdiag_ttft_p99_seconds", "kvdiag_concurrency_ceiling", "kvdiag_check_status",
    "kvdiag_verdict", "kvdiag_build_info",
}  # fmt: skip


def client_for(loop: ScrapeLoop) -> TestClient:
    return TestClient(create_app(loop), base_url="http://127.0.0.1:10877")


def diagnosed(loop: ScrapeLoop) -> bool:
    states = loop.snapshot()
    return bool(states) and all(s.instances and all(i.diagnosis and i.diagnosis.samples >= 4 for i in s.instances.values()) for s in states)


@pytest.fixture
def served(engines: dict[str, MetricsServer], start_loop: Callable[[Settings], ScrapeLoop]) -> TestClient:
    loop = start_loop(settings_for([engines["sglang"].url, engines["vllm"].url], interval=0.25))
    assert wait_for(lambda: diagnosed(loop))
    return client_for(loop)


def test_verdicts_reach_metrics(served: TestClient) -> None:
    resp = served.get("/metrics")
    assert resp.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(resp.text)}
    assert FAMILIES <= set(fams)
    assert not [n for n in fams if ":" in n]
    verdicts = [(s.labels["engine"], s.labels["verdict"]) for s in fams["kvdiag_verdict"].samples if s.value == 1]
    assert sorted(verdicts) == [("sglang", "l1_kv_bottleneck"), ("vllm", "l1_kv_bottleneck")]
    assert len(fams["kvdiag_verdict"].samples) == 2 * len(VERDICTS)  # one-hot over every verdict
    states = {s.labels["state"] for s in fams["kvdiag_kv_pool_tokens"].samples if s.labels["engine"] == "sglang"}
    assert states == {"used", "evictable", "available"}
    firing = {s.labels["check"] for s in fams["kvdiag_check_status"].samples if s.value == 1}
    assert {"kv_usage_saturated", "queue_growing", "evictions_growing"} <= firing
    for s in fams["kvdiag_up"].samples:
        assert s.value == 1 and set(s.labels) == {"instance", "engine", "model"}
    ratio = {s.labels["engine"]: s.value for s in fams["kvdiag_kv_usage_ratio"].samples}
    admission = {s.labels["engine"]: s.value for s in fams["kvdiag_kv_admission_usage_ratio"].samples}
    assert set(ratio) == set(admission) == {"sglang", "vllm"}
    assert all(0 <= ratio[e] <= admission[e] <= 1 for e in ratio)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (scripts/system-deps.sh)")
def test_promtool_checks_metrics(served: TestClient) -> None:
    body = served.get("/metrics").text
    out = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_api_serves_the_diagnose_json_shape_and_window_series(served: TestClient) -> None:
    report = served.get("/api/v1/verdicts").json()
    assert report["exit_code"] == 2
    for inst in report["instances"]:
        assert {"instance", "engine", "verdict", "findings", "checks", "remedies"} <= set(inst)
        assert inst["verdict"] == "l1_kv_bottleneck"
        assert all({"status", "evidence"} <= set(c) for c in inst["checks"].values())
    rows = served.get("/api/v1/instances").json()["instances"]
    assert {r["latest"]["engine"] for r in rows} == {"sglang", "vllm"} and all(r["up"] for r in rows)
    name = urllib.parse.quote(rows[0]["instance"], safe="")
    series = served.get(f"/api/v1/instances/{name}/series?fields=waiting,usage_ratio").json()
    assert len(series["ts"]) == len(series["series"]["waiting"]) >= 4 and set(series["series"]) == {"waiting", "usage_ratio"}
    assert served.get(f"/api/v1/instances/{name}/series?fields=nope").status_code == 400
    assert served.get("/api/v1/instances/http%3A%2F%2Fnowhere/series").status_code == 404


def test_health_readiness_and_openapi(served: TestClient) -> None:
    assert served.get("/healthz").status_code == 200
    assert served.get("/readyz").json()["status"] == "ready"
    paths = served.get("/openapi.json").json()["paths"]
    assert {"/metrics", "/probe", "/api/v1/instances", "/api/v1/verdicts", "/api/v1/instances/{instance}/series"} <= set(paths)
    assert "swagger" in served.get("/docs").text.lower()


def test_readiness_waits_for_the_first_scrape(start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    loop = ScrapeLoop(settings_for(["http://127.0.0.1:9"]))  # not started: nothing scraped yet
    try:
        assert client_for(loop).get("/readyz").status_code == 503
    finally:
        loop.stop()


def test_api_token(engines: dict[str, MetricsServer], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    from dataclasses import replace

    loop = start_loop(replace(settings_for([engines["sglang"].url]), api_token="t0ken"))
    client = client_for(loop)
    assert client.get("/api/v1/verdicts").status_code == 401
    assert client.get("/api/v1/verdicts", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/api/v1/instances", headers={"Authorization": "Bearer t0ken"}).status_code == 200
    assert client.get("/metrics").status_code == 200  # Prometheus' endpoints stay open
    assert client.get("/healthz").status_code == 200


def test_probe_scrapes_allowed_targets_into_their_own_window(engines: dict[str, MetricsServer], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    from dataclasses import replace

    loop = start_loop(replace(settings_for([]), probe=ProbeSettings(Allowlist.build(cidrs=["127.0.0.0/8"]))))
    client = client_for(loop)
    target = engines["vllm"].url
    for _ in range(4):
        resp = client.get("/probe", params={"target": target, "engine": "vllm"})
        assert resp.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(resp.text)}
    assert "kvdiag_build_info" not in fams and fams["kvdiag_up"].samples[0].value == 1
    assert len(loop.probes[target].instances) == 1
    assert len(next(iter(loop.probes[target].instances.values())).ring) == 4
    assert "kvdiag_verdict" in fams
    assert client.get("/metrics").text.count("kvdiag_up{") == 0  # probes are not configured targets
    for refused in ("http://169.254.169.254/latest/meta-data/", "http://metadata.google.internal/", "http://[fd00:ec2::254]/", "http://192.0.2.1:8000"):
        resp = client.get("/probe", params={"target": refused})
        assert resp.status_code == 403, refused
    assert client.get("/probe", params={"target": target, "engine": "tgi"}).status_code == 400


def test_a_down_or_non_engine_target_is_up_0_and_unknown_with_its_reason(raw_server, start_loop: Callable[[Settings], ScrapeLoop]) -> None:  # type: ignore[no-untyped-def]
    from tests.server.conftest import reply

    url = raw_server(lambda h: reply(h, 200, b"# TYPE node_load1 gauge\nnode_load1 0.5\n"))
    loop = start_loop(settings_for([url]))
    assert wait_for(lambda: loop.ready)
    client = client_for(loop)
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert [(s.labels["instance"], s.value) for s in fams["kvdiag_up"].samples] == [(url, 0)]
    assert [s.labels["verdict"] for s in fams["kvdiag_verdict"].samples if s.value == 1] == ["unknown"]
    assert "kvdiag_kv_usage_ratio" not in fams or not fams["kvdiag_kv_usage_ratio"].samples
    report = client.get("/api/v1/verdicts").json()
    assert report["exit_code"] == 3
    (inst,) = report["instances"]
    assert inst["verdict"] == "unknown" and "unknown engine" in inst["reason"] and "node" in inst["reason"]
    (row,) = client.get("/api/v1/instances").json()["instances"]
    assert row["up"] is False and "unknown engine" in row["error"]


def test_probe_never_follows_a_redirect_past_the_allowlist(raw_server, start_loop: Callable[[Settings], ScrapeLoop]) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from tests.server.conftest import reply

    hits: list[str] = []
    secret = raw_server(lambda h: (hits.append(h.path), reply(h, 200, b"secret 1\n")))

    def redirect(h):  # type: ignore[no-untyped-def]
        h.send_response(302)
        h.send_header("Location", secret + "/latest/meta-data/")
        h.send_header("Content-Length", "0")
        h.end_headers()

    allowed = raw_server(redirect)
    port = allowed.rsplit(":", 1)[1]
    loop = start_loop(replace(settings_for([]), probe=ProbeSettings(Allowlist.build(regex=rf"http://127\.0\.0\.1:{port}"))))
    client = client_for(loop)
    resp = client.get("/probe", params={"target": allowed})
    assert resp.status_code == 200 and 'kvdiag_up{engine="",instance="' + allowed + '",model=""} 0.0' in resp.text
    assert client.get("/probe", params={"target": secret}).status_code == 403
    assert hits == []
    assert "redirect" in (loop.probes[allowed].error or "").lower()


def test_docs_work_offline(start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    import re

    loop = ScrapeLoop(settings_for([]))
    try:
        client = client_for(loop)
        html = client.get("/docs").text
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html) + re.findall(r"""url: *["']([^"']+)["']""", html)
        assert "://" not in html and assets and all(a.startswith("/") for a in assets), assets
        for asset in assets:
            resp = client.get(asset)
            assert resp.status_code == 200 and resp.content, asset
        assert "SwaggerUIBundle" in client.get("/docs-assets/swagger-ui-bundle.js").text
    finally:
        loop.stop()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer "},
        {"Authorization": "Bearer t0ke"},
        {"Authorization": "Bearer t0ken2"},
        {"Authorization": "Bearer T0KEN"},
        {"Authorization": "bearer wrong"},
        {"Authorization": "Basic dDBrZW46dDBrZW4="},  # t0ken:t0ken as basic auth
        {"Authorization": "Token t0ken"},
        {"Authorization": "t0ken"},
        {"Authorization": "Bearer t0ken, Bearer x"},
        {"X-Api-Token": "t0ken"},
        {"Cookie": "token=t0ken"},
    ],
)
def test_api_auth_attempts_are_refused(headers: dict[str, str], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    from dataclasses import replace

    loop = ScrapeLoop(replace(settings_for([]), api_token="t0ken"))
    try:
        client = client_for(loop)
        for path in ("/api/v1/instances", "/api/v1/verdicts", "/api/v1/instances/x/series", "/api/v1/verdicts?token=t0ken"):
            resp = client.get(path, headers=headers)
            assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer", (path, headers)
            assert "t0ken" not in resp.text
        assert client.get("/api/v1/verdicts", headers={"Authorization": "Bearer t0ken"}).status_code == 200
        assert client.get("/api/v1/verdicts", headers={"Authorization": "bearer t0ken"}).status_code == 200  # the scheme is case-insensitive (RFC 7235)
    finally:
        loop.stop()
