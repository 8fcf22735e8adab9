"""`serve` against a zoo of broken loopback targets: each bad one is `kvdiag_up 0` with its
reason, the healthy ones keep their schedule, no target's scrape outlives its deadline, and
/probe floods never reach /healthz. Counts over generous spans, never tight timing."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from typing import Callable, Iterator

import numpy as np
import pytest
import requests
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.refpool.emit import content_type, render
from kvdiag.refpool.scripted import SaturationStory
from kvdiag.server.app import create_app
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.probe import Allowlist
from kvdiag.server.settings import ProbeSettings, ScrapeSettings, Settings
from kvdiag.sources.scrape import Auth
from tests.server.conftest import Handle, reply, settings_for, story_engine, wait_for

#: The zoo's scrape deadline outlasts many intervals: a good target's scrape never races a busy
#: machine, and a bad target holding a worker until it, if that delayed the healthy ones, would
#: cost them many intervals (asserted below as counts, never as tight timing).
INTERVAL, TIMEOUT = 0.5, 6.0


def drip(h: BaseHTTPRequestHandler, data: bytes, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.wait(0.1):
            return
        h.wfile.write(data[i : i + 1])
        h.wfile.flush()


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def zoo(stop: threading.Event) -> dict[str, Handle]:
    story = SaturationStory()
    body = render("sglang", [story.state(100)], openmetrics=False).encode()
    inf_body = b"\n".join(
        (line.rsplit(b" ", 1)[0] + b" +Inf") if line.startswith(b"sglang:max_total_num_tokens") else line for line in body.split(b"\n")
    )
    bad_le = body.replace(b'time_to_first_token_seconds_bucket{', b'time_to_first_token_seconds_bucket{le="0,4",', 1)
    chunk = b"# padding\n" * 6554

    def drip_body(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; version=0.0.4")
        h.end_headers()
        drip(h, body, stop)

    def drip_headers(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"HTTP/1.1 200 OK\r\n")
        drip(h, b"X-Slow: " + b"a" * 10_000 + b"\r\n\r\n", stop)

    def huge(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.end_headers()
        while not stop.is_set():
            h.wfile.write(chunk)

    return {
        "hang": lambda h: stop.wait(30),
        "drip_headers": drip_headers,
        "drip_body": drip_body,
        "error": lambda h: reply(h, 500, b"boom"),
        "huge": huge,
        "garbage": lambda h: reply(h, 200, os.urandom(4096)),
        "html": lambda h: reply(h, 200, b"<!doctype html><html><body>login</body></html>", "text/html"),
        "inf": lambda h: reply(h, 200, inf_body),
        "bad_le": lambda h: reply(h, 200, bad_le),
    }


REASONS = {
    "hang": f"timed out after {TIMEOUT:g}s in all (during the headers)",
    "drip_headers": f"timed out after {TIMEOUT:g}s in all (during the headers)",
    "drip_body": f"timed out after {TIMEOUT:g}s in all (during the body)",
    "error": "HTTP 500",
    "huge": "exceeds the",
    "garbage": "",
    "html": "",
}


def metrics(client: requests.Session, base: str) -> dict[str, float]:
    text = client.get(base + "/metrics", timeout=10).text
    return {s.labels["instance"]: s.value for f in text_string_to_metric_families(text) if f.name == "kvdiag_up" for s in f.samples}


@pytest.fixture
def live() -> Iterator[Callable[[ScrapeLoop], str]]:
    """The real app on uvicorn in a thread, on a loopback socket."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(loop: ScrapeLoop) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(create_app(loop), log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert wait_for(lambda: server.started)
        return base

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_zoo_is_down_with_reasons_and_the_healthy_keep_their_schedule(
    raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop], live: Callable[[ScrapeLoop], str], stop: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    healthy = [story_engine("sglang"), story_engine("vllm")]
    try:
        bad = {name: raw_server(handle) for name, handle in zoo(stop).items()}
        settings = settings_for([h.url for h in healthy] + list(bad.values()), interval=INTERVAL, timeout=TIMEOUT)
        loop = start_loop(replace(settings, scrape=replace(settings.scrape, concurrency=6, max_bytes=1 << 20)))
        base = live(loop)
        http = requests.Session()
        assert wait_for(lambda: requests.get(base + "/readyz", timeout=10).status_code == 200)  # every drip target ended
        before = {h.url: _samples(loop, h.url) for h in healthy}
        assert wait_for(lambda: all(_samples(loop, h.url) - before[h.url] >= 3 for h in healthy))
        for h in healthy:  # on the loop's own clock, 3 scrapes 2 intervals apart; waiting on the bad ones, 2 timeouts
            assert _last_span(loop, h.url, 3) < TIMEOUT, (h.url, _last_span(loop, h.url, 3))
        up = metrics(http, base)
        rows = {r["target"]: r for r in http.get(base + "/api/v1/instances", timeout=10).json()["instances"]}
        for name, url in bad.items():
            if name == "bad_le":  # refused or read without that bucket: either way this target's alone
                assert url in rows and (rows[url]["up"] is False) == bool(rows[url]["error"])
                continue
            if name == "inf":  # an impossible pool size is absent, the rest of the target is read
                assert rows[url]["up"] is True and rows[url]["latest"]["capacity_tokens"] is None, rows[url]
                assert [v for k, v in up.items() if k.startswith(url)] == [1]
                continue
            assert up[url] == 0, name
            assert rows[url]["up"] is False and REASONS[name] in rows[url]["error"], (name, rows[url]["error"])
            assert rows[url]["scrape_duration_seconds"] < TIMEOUT + 2.0  # the deadline held (generous slack)
        for h in healthy:
            assert any(v == 1 for k, v in up.items() if k.startswith(h.url))
        assert http.get(base + "/api/v1/verdicts", timeout=10).status_code == 200
        assert http.get(base + "/", timeout=10).status_code == 200
        tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
        assert len(tracebacks) == len(set(tracebacks))  # never the same traceback every scrape
    finally:
        for h in healthy:
            h.stop()


def test_a_target_that_restarts_comes_back_up(start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    """Down (connection refused) while the engine restarts, up again on the same port after."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    loop = start_loop(settings_for([url], interval=0.3))
    assert wait_for(lambda: loop.ready)
    state = loop.targets[url]
    assert not state.up and "connection refused" in (state.error or "")
    from kvdiag.refpool.serve import MetricsServer

    story = SaturationStory()
    engine = MetricsServer(lambda om: (render("vllm", [story.state(100)], openmetrics=om, escape=om), content_type(om)), port=port).start()
    try:
        assert wait_for(lambda: state.up and bool(state.instances)), state.error
    finally:
        engine.stop()


def test_two_drip_targets_cannot_starve_two_healthy_ones_with_two_workers(
    raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop], stop: threading.Event
) -> None:
    handles = zoo(stop)
    healthy = [story_engine("sglang"), story_engine("vllm")]
    try:
        drips = [raw_server(handles["drip_body"]), raw_server(handles["drip_headers"])]
        settings = settings_for([h.url for h in healthy] + drips, interval=2.0, timeout=1.5)  # the healthy scrapes never near it
        loop = start_loop(replace(settings, scrape=replace(settings.scrape, concurrency=2)))
        assert wait_for(lambda: loop.ready)
        before = {h.url: _samples(loop, h.url) for h in healthy}
        # two more samples of each healthy target while the drips hold their workers (the old
        # reader managed 0): counted in scrape cycles, with a hang guard, not in wall seconds
        fed = lambda: all(_samples(loop, h.url) - before[h.url] >= 2 for h in healthy)  # noqa: E731
        assert wait_for(fed), {h.url: _samples(loop, h.url) - before[h.url] for h in healthy}
        for url in drips:
            assert not loop.targets[url].up and "timed out" in (loop.targets[url].error or "")
    finally:
        for h in healthy:
            h.stop()


def _samples(loop: ScrapeLoop, url: str) -> int:
    return sum(len(i.ring) for i in loop.targets[url].instances.values())


def _last_span(loop: ScrapeLoop, url: str, n: int) -> float:
    """Seconds between a target's last ``n`` samples, as the loop stamped them."""
    (inst,) = loop.targets[url].instances.values()
    ts = np.sort(inst.ring.ts[~np.isnan(inst.ring.ts)])
    return float(ts[-1] - ts[-n])


def test_a_probe_flood_never_reaches_healthz(raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop], live: Callable[[ScrapeLoop], str], stop: threading.Event) -> None:
    connections = []

    def hang(h: BaseHTTPRequestHandler) -> None:
        connections.append(1)
        stop.wait(30)

    target = raw_server(hang)
    probe = ProbeSettings(Allowlist.build(cidrs=["127.0.0.0/8"]), concurrency=4)
    loop = start_loop(replace(settings_for([], interval=10.0, timeout=5.0), probe=probe))  # slots held all through the flood
    base = live(loop)
    statuses: list[int] = []

    def one() -> None:
        statuses.append(requests.get(base + "/probe", params={"target": target}, timeout=30).status_code)

    flood = [threading.Thread(target=one) for _ in range(60)]
    for t in flood:
        t.start()
    assert wait_for(lambda: len(connections) >= 1 and len(statuses) >= 60 - 4)  # all sent: 4 held, the rest answered
    health = requests.get(base + "/healthz", timeout=15)  # hang guard: the flood held it 83 s before
    metrics_page = requests.get(base + "/metrics", timeout=15)
    stop.set()  # the target hangs up: the probes holding the workers end now
    for t in flood:
        t.join(timeout=30)
    assert health.status_code == 200 and metrics_page.status_code == 200
    assert len(statuses) == 60 and statuses.count(503) >= 60 - 4 and set(statuses) <= {200, 503}
    assert len(connections) <= 4  # one connection per probe worker at most, never 60


def test_credentials_go_only_where_they_are_configured(raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    seen: list[str | None] = []

    def engine(h: BaseHTTPRequestHandler) -> None:
        seen.append(h.headers.get("Authorization"))
        reply(h, 500, b"no")

    url = raw_server(engine)
    port = url.rsplit(":", 1)[1]
    allow = Allowlist.build(cidrs=["127.0.0.0/8"])
    scrape = ScrapeSettings(interval=5.0, timeout=1.0, auth=Auth(bearer="ENGINE-TOKEN"))
    loop = start_loop(replace(settings_for([]), scrape=scrape, probe=ProbeSettings(allow)))
    loop.probe(url)
    assert seen == [None]  # scrape.auth is for configured targets only
    from kvdiag.server.settings import ProbeCredentials

    named = ProbeSettings(allow, credentials=(ProbeCredentials(frozenset({"localhost"}), Auth(bearer="PROBE-TOKEN")),))
    loop = start_loop(replace(settings_for([]), scrape=scrape, probe=named))
    loop.probe(url)
    assert seen[-1] is None  # an entry for another host sends nothing to this one
    loop.probe(f"http://localhost:{port}")
    assert seen[-1] == "Bearer PROBE-TOKEN"


def test_userinfo_becomes_basic_auth_and_appears_nowhere(raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop], caplog: pytest.LogCaptureFixture) -> None:
    from fastapi.testclient import TestClient

    from kvdiag.server.targets import make_target

    seen: list[str | None] = []

    def engine(h: BaseHTTPRequestHandler) -> None:
        seen.append(h.headers.get("Authorization"))
        reply(h, 503, b"")

    url = raw_server(engine)
    secret_url = url.replace("http://", "http://scraper:hunter2@")
    loop = start_loop(replace(settings_for([]), targets=(make_target(secret_url, None, ""),)))
    caplog.set_level("DEBUG")
    assert wait_for(lambda: loop.ready)
    assert seen[0] == "Basic c2NyYXBlcjpodW50ZXIy"  # scraper:hunter2
    client = TestClient(create_app(loop), base_url="http://127.0.0.1:10877")
    outputs = [client.get("/metrics").text, client.get("/api/v1/instances").text, client.get("/api/v1/verdicts").text, caplog.text, repr(loop.targets)]
    assert all("hunter2" not in out for out in outputs)
    assert url in outputs[0]


@pytest.mark.parametrize("stage", ["normalize", "checks", "metrics", "api"])
def test_a_failure_at_any_stage_stays_with_its_target(stage: str, engines, start_loop: Callable[[Settings], ScrapeLoop], monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    import kvdiag.checks
    import kvdiag.server.app as app_module
    import kvdiag.server.collector as collector
    import kvdiag.server.state as state_module

    good, bad = engines["sglang"].url, engines["vllm"].url

    def broken(fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            if any(bad in str(getattr(a, "url", "")) or bad in str(getattr(a, "target", "")) or str(getattr(a, "instance", "")).startswith(bad) for a in args):
                raise ArithmeticError("injected")
            return fn(*args, **kwargs)

        return wrapper

    diagnose = kvdiag.checks.diagnose
    if stage == "normalize":
        monkeypatch.setattr(state_module, "normalize_scrape", broken(state_module.normalize_scrape))
    elif stage == "checks":
        diagnose = broken(diagnose)
    elif stage == "metrics":
        monkeypatch.setattr(collector, "_instance", broken(collector._instance))
    else:
        monkeypatch.setattr(app_module, "_instance_rows", broken(app_module._instance_rows))
        monkeypatch.setattr(app_module, "_diagnoses", broken(app_module._diagnoses))
    loop = ScrapeLoop(settings_for([good, bad], interval=0.3), diagnose=diagnose).start()
    try:
        def answered() -> bool:
            insts = list(loop.targets[good].instances.values())
            return loop.ready and bool(insts) and all(i.diagnosis and i.diagnosis.verdict.name != "unknown" for i in insts)

        assert wait_for(answered)
        client = TestClient(create_app(loop), base_url="http://127.0.0.1:10877")
        resp_metrics, resp_rows, resp_verdicts = client.get("/metrics"), client.get("/api/v1/instances"), client.get("/api/v1/verdicts")
        assert resp_metrics.status_code == resp_rows.status_code == resp_verdicts.status_code == 200
        fams = {f.name: f for f in text_string_to_metric_families(resp_metrics.text)}
        up = {s.labels["instance"]: s.value for s in fams["kvdiag_up"].samples}
        verdict = {s.labels["instance"]: s.labels["verdict"] for s in fams["kvdiag_verdict"].samples if s.value == 1}
        assert [v for k, v in up.items() if k.startswith(good)] == [1]
        assert [v for k, v in verdict.items() if k.startswith(good)] != ["unknown"]
        bad_verdicts = [v for k, v in verdict.items() if k.startswith(bad)]
        assert bad_verdicts == ["unknown"] or stage == "api"
        rows = resp_rows.json()["instances"]
        assert any(r["target"] == good and r["latest"] for r in rows)
        bad_rows = [r for r in rows if r["target"] == bad]
        if stage != "metrics":
            assert bad_rows and all("internal error" in (r["reason"] or "") for r in bad_rows), bad_rows
        report = resp_verdicts.json()["instances"]
        assert any(i["instance"].startswith(good) and i["verdict"] != "unknown" for i in report)
    finally:
        loop.stop()


def test_a_probe_keeps_within_prometheus_timeout(raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop], stop: threading.Event) -> None:
    from fastapi.testclient import TestClient

    from kvdiag.server.app import prometheus_budget

    target = raw_server(lambda h: stop.wait(30))
    loop = start_loop(replace(settings_for([], interval=10.0, timeout=8.0), probe=ProbeSettings(Allowlist.build(cidrs=["127.0.0.0/8"]))))
    resp = TestClient(create_app(loop), base_url="http://127.0.0.1:10877").get("/probe", params={"target": target}, headers={"X-Prometheus-Scrape-Timeout-Seconds": "1.5"})
    assert resp.status_code == 200 and "timed out after 1s in all" in (loop.probes[target].error or "")
    assert prometheus_budget("10") == 9.5 and prometheus_budget("0.4") == 0.2
    assert prometheus_budget(None) is prometheus_budget("soon") is prometheus_budget("nan") is prometheus_budget("-1") is None
