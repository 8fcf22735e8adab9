"""Issue 30, item 7: an exporter on loopback without a token answers only requests whose Host
names this machine, so a web page that rebinds its own name to 127.0.0.1 reads nothing."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import pytest
from fastapi.testclient import TestClient

from kvdiag.server.app import create_app, loopback_host
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.probe import Allowlist
from kvdiag.server.settings import ProbeSettings, Settings
from tests.server.conftest import settings_for

PATHS = ["/api/v1/instances", "/api/v1/verdicts", "/probe?target=http://127.0.0.1:9", "/metrics", "/", "/readyz"]


def client(start_loop: Callable[[Settings], ScrapeLoop], host: str = "127.0.0.1", token: str | None = None) -> TestClient:
    settings = replace(settings_for([]), host=host, api_token=token, probe=ProbeSettings(Allowlist.build(cidrs=["127.0.0.0/8"])))
    return TestClient(create_app(start_loop(settings)), base_url="http://127.0.0.1:10877")


@pytest.mark.parametrize("path", PATHS)
def test_a_rebound_name_is_refused_on_loopback_without_a_token(start_loop: Callable[[Settings], ScrapeLoop], path: str) -> None:
    c = client(start_loop)
    resp = c.get(path, headers={"Host": "rebind.evil.example"})
    assert resp.status_code == 403 and "DNS rebinding guard" in resp.json()["detail"]
    for host in ("localhost:10877", "127.0.0.1:10877", "[::1]:10877", "localhost", "127.0.0.2", "LOCALHOST."):
        assert c.get(path, headers={"Host": host}).status_code != 403, host


def test_the_refusal_quotes_the_host_bounded(start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    detail = client(start_loop).get("/api/v1/instances", headers={"Host": "x" * 5000}).json()["detail"]
    assert len(detail) < 400


@pytest.mark.parametrize("host", ["127.0.0.1:10877.evil.example", "127.0.0.1.evil.example", "[::1].evil", "evil:80:80", ""])
def test_lookalike_hosts(host: str) -> None:
    assert not loopback_host(host)


def test_with_a_token_or_beyond_loopback_the_host_is_not_checked(start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    c = client(start_loop, token="s3cret")
    assert c.get("/api/v1/instances", headers={"Host": "exporter.internal"}).status_code == 401
    assert c.get("/api/v1/instances", headers={"Host": "exporter.internal", "Authorization": "Bearer s3cret"}).status_code == 200
    c = client(start_loop, host="0.0.0.0")
    assert c.get("/api/v1/instances", headers={"Host": "exporter.internal"}).status_code == 200
