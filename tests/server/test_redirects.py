"""Issue 30, item 1: one redirect policy for every outbound request, and nothing of a refused or
failing target's answer quoted beyond a bounded, escaped excerpt.

Real loopback servers play the targets. 169.254.169.254 cannot be reached from here, so the
redirect to it is shown refused before any connection (every address the scrape connects to is
recorded); a loopback "metadata" server on another port holds a secret and must never be asked.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Callable

import pytest
from fastapi.testclient import TestClient

from kvdiag.server.app import create_app
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.probe import Allowlist
from kvdiag.server.settings import ProbeSettings, Settings
from kvdiag.sources import scrape as scrape_module
from kvdiag.sources.egress import RedirectRefused, follow
from kvdiag.sources.prometheus import PrometheusError, read_window
from kvdiag.sources.scrape import Auth, ScrapeError, scrape
from tests.server.conftest import Handle, reply, settings_for, wait_for

METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"
SECRET = "AKIAKVDIAGSECRETKEY"
SECRET_BODY = f'{{"Code":"Success","AccessKeyId":"{SECRET}"}}\nrole_{SECRET} 1\n{SECRET}-role\n'.encode()


def redirector(location: str, body: bytes = SECRET_BODY) -> Handle:
    """Answers every GET with a 302 to ``location``, its body holding the secret too."""

    def handle(h: BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return handle


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every (address, port) a scrape opens a connection to."""
    seen: list[tuple[str, int]] = []
    real = scrape_module._connect

    def record(addresses, port, deadline):  # type: ignore[no-untyped-def]
        seen.extend((a, port) for a in addresses)
        return real(addresses, port, deadline)

    monkeypatch.setattr(scrape_module, "_connect", record)
    return seen


@pytest.fixture
def metadata(raw_server: Callable[[Handle], str]) -> tuple[str, list[str]]:
    """A loopback stand-in for a metadata service: its URL, and the paths it was asked for."""
    asked: list[str] = []
    url = raw_server(lambda h: (asked.append(h.path), reply(h, 200, SECRET_BODY)))
    return url, asked


def test_a_redirect_to_metadata_is_refused_before_any_connection(raw_server: Callable[[Handle], str], connects: list[tuple[str, int]]) -> None:
    target = raw_server(redirector(METADATA))
    port = int(target.rsplit(":", 1)[1])
    with pytest.raises(ScrapeError) as err:
        scrape(target, timeout=5, auth=Auth(bearer="engine-token"))
    assert "redirect to 'http://169.254.169.254/latest/meta-data/iam/security-credentials/' refused: a link-local / cloud metadata address" in str(err.value)
    assert connects == [("127.0.0.1", port)]  # the target only: 169.254.169.254 never dialled
    assert SECRET not in str(err.value)


@pytest.mark.parametrize(
    "location",
    [
        "http://[fe80::a9fe:a9fe]/latest/",
        "http://[::ffff:169.254.169.254]/",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://100.100.100.200/latest/meta-data/",
        "https://169.254.170.2/v2/credentials",
    ],
)
def test_every_metadata_form_is_named_as_such(location: str) -> None:
    with pytest.raises(RedirectRefused, match="a link-local / cloud metadata address"):
        follow("http://10.0.0.5:8000/metrics", 302, location)


def test_the_policy_keeps_to_the_origin() -> None:
    assert follow("http://10.0.0.5:8000/metrics", 307, "/metrics/") == "http://10.0.0.5:8000/metrics/"
    assert follow("http://h/metrics", 301, "https://h/metrics") == "https://h/metrics"  # upgrade on default ports
    assert follow("http://u:p@h:1/m", 302, "http://x:y@h:1/n") == "http://h:1/n"  # no userinfo travels
    for location in ("http://10.0.0.6:8000/metrics", "http://10.0.0.5:8001/", "https://10.0.0.5:8000/", "ftp://10.0.0.5:8000/", "http://a b/", "http://h:0/"):
        with pytest.raises(RedirectRefused, match="refused"):
            follow("http://10.0.0.5:8000/metrics", 302, location)
    with pytest.raises(RedirectRefused) as err:
        follow("http://h/m", 302, "http://evil.example/" + "\x1b[2J" + "a" * 500)
    assert "\x1b" not in str(err.value) and len(str(err.value)) < 400  # quoted bounded and escaped


def test_a_cross_host_redirect_never_reaches_the_other_server(raw_server: Callable[[Handle], str], metadata: tuple[str, list[str]]) -> None:
    meta_url, asked = metadata
    target = raw_server(redirector(meta_url + "/latest/meta-data/"))
    with pytest.raises(ScrapeError, match="refused: kvdiag follows redirects within the target's own scheme, host and port only"):
        scrape(target, timeout=5)
    assert asked == []


def _settings_file_sd(tmp_path: Path, url: str) -> Settings:
    sd = tmp_path / "engines.json"
    sd.write_text(json.dumps([{"targets": [url]}]))
    return replace(settings_for([]), file_sd=(sd,))


@pytest.mark.parametrize("how", ["config", "file_sd"])
def test_configured_and_file_sd_targets_leak_nothing(
    how: str,
    tmp_path: Path,
    raw_server: Callable[[Handle], str],
    metadata: tuple[str, list[str]],
    start_loop: Callable[[Settings], ScrapeLoop],
    caplog: pytest.LogCaptureFixture,
) -> None:
    meta_url, asked = metadata
    to_metadata = raw_server(redirector(METADATA))
    to_loopback = raw_server(redirector(meta_url + "/latest/meta-data/iam/security-credentials/role"))
    urls = [to_metadata, to_loopback]
    caplog.set_level(logging.DEBUG, logger="kvdiag")
    if how == "config":
        settings = settings_for(urls)
    else:
        settings = _settings_file_sd(tmp_path, to_metadata)
        settings = replace(settings, targets=settings_for([to_loopback]).targets)
    loop = start_loop(settings)
    assert wait_for(lambda: len(loop.snapshot()) == 2 and all(s.last_scrape is not None for s in loop.snapshot()), timeout=20)
    client = TestClient(create_app(loop), base_url="http://127.0.0.1:10877")
    instances = client.get("/api/v1/instances").text
    verdicts = client.get("/api/v1/verdicts").text
    for text in (instances, verdicts, caplog.text):
        assert SECRET not in text and "AccessKeyId" not in text
    rows = {r["target"]: r for r in client.get("/api/v1/instances").json()["instances"]}
    assert "a link-local / cloud metadata address" in rows[to_metadata]["error"]
    assert "within the target's own scheme, host and port only" in rows[to_loopback]["error"]
    assert asked == []


def test_probe_keeps_the_same_policy(raw_server: Callable[[Handle], str], metadata: tuple[str, list[str]], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    meta_url, asked = metadata
    target = raw_server(redirector(meta_url + "/"))
    # the allowlist covers both loopback servers: only the redirect policy stands in the way
    loop = start_loop(replace(settings_for([]), probe=ProbeSettings(Allowlist.build(cidrs=["127.0.0.0/8"]))))
    client = TestClient(create_app(loop), base_url="http://127.0.0.1:10877")
    resp = client.get("/probe", params={"target": target})
    assert resp.status_code == 200 and SECRET not in resp.text
    assert "within the target's own scheme, host and port only" in (loop.probes[target].error or "")
    assert asked == []


def test_the_prometheus_source_keeps_the_same_policy(raw_server: Callable[[Handle], str], metadata: tuple[str, list[str]]) -> None:
    meta_url, asked = metadata
    for location in (METADATA, meta_url + "/api/v1/query_range"):
        prom = raw_server(redirector(location))
        with pytest.raises(PrometheusError, match="refused") as err:
            read_window(prom, since=60, timeout=5)
        assert SECRET not in str(err.value)
    assert asked == []


def test_a_prometheus_error_is_quoted_bounded(raw_server: Callable[[Handle], str]) -> None:
    body = json.dumps({"status": "error", "errorType": "bad_data", "error": "\x1b[31m" + "x" * 5000}).encode()
    prom = raw_server(lambda h: reply(h, 400, body, "application/json"))
    with pytest.raises(PrometheusError) as err:
        read_window(prom, since=60, timeout=5)
    assert "\x1b" not in str(err.value) and len(str(err.value)) < 600
