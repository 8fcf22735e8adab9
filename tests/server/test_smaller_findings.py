"""Issue 30, item 10: credentials in a target URL, malformed /probe targets, invalid URLs at
config load, and the instance cap on the command line (recorded passwords: see
tests/test_recording_damage.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Callable

import pytest
from fastapi.testclient import TestClient

from kvdiag.config import ConfigError
from kvdiag.refpool.emit import EngineState, render
from kvdiag.server import settings as serve_settings
from kvdiag.server.app import create_app
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.probe import Allowlist
from kvdiag.server.settings import ProbeSettings, Settings
from kvdiag.server.targets import FileSD
from kvdiag.sources.scrape import Auth, scrape
from tests.server.conftest import Handle, reply, settings_for, wait_for

BODY = render("sglang", [EngineState(capacity_tokens=1000, used_tokens=500)]).encode()


def test_credentials_in_a_target_url_are_sent_as_basic_auth_not_replaced(tmp_path: Path, raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    seen: list[str | None] = []

    def handle(h: BaseHTTPRequestHandler) -> None:
        seen.append(h.headers.get("Authorization"))
        reply(h, 200, BODY)

    url = raw_server(handle)
    (tmp_path / "token").write_text("shared-bearer\n")
    config = tmp_path / "kvdiag.yaml"
    config.write_text(f"scrape:\n  interval: 1s\n  auth: {{bearer_token_file: token}}\ntargets:\n  - {url.replace('http://', 'http://kv:pw@')}\n  - {url}/other\n")
    settings = serve_settings.load(config)
    loop = start_loop(settings)
    assert wait_for(lambda: all(s.last_scrape is not None for s in loop.snapshot()), timeout=20)
    assert "Basic a3Y6cHc=" in seen and "Bearer shared-bearer" in seen  # kv:pw to its target, the bearer to the other
    seen.clear()
    scrape(url.replace("http://", "http://kv:pw@"), timeout=5, auth=Auth(bearer="shared-bearer"))
    assert seen == ["Basic a3Y6cHc="]


@pytest.mark.parametrize(
    "target, words",
    [
        ("http://127.0.0.1:9/a\r\nX-Injected: 1", "spaces or control characters"),
        ("http://127.0.0.1:9/a\nb", "spaces or control characters"),
        ("http://127.0.0.1:0/metrics", "the port is not a number from 1 to 65535"),
        ("http://127.0.0.1:/metrics", "the port is not a number from 1 to 65535"),
        ("http://127.0.0.1:99999/", "the port is not a number from 1 to 65535"),
        ("http://a b:80/", "spaces or control characters"),
        ("http://[127.0.0.1]/", "cannot be in brackets"),
    ],
)
def test_malformed_probe_targets_are_400_and_never_kept(start_loop: Callable[[Settings], ScrapeLoop], target: str, words: str) -> None:
    loop = start_loop(replace(settings_for([]), probe=ProbeSettings(Allowlist.build(cidrs=["127.0.0.0/8"]))))
    client = TestClient(create_app(loop), base_url="http://127.0.0.1:10877")
    resp = client.get("/probe", params={"target": target})
    assert resp.status_code == 400 and words in resp.json()["detail"], resp.text
    assert not loop.probes


@pytest.mark.parametrize("url", ["http://a b:80", "http://10.0.0.5:8000/met\nrics", "http://10.0.0.5:\n", "http://10.0.0.5:8000/\x00", "http://-bad-.example:80"])
def test_invalid_urls_are_refused_at_config_load(tmp_path: Path, url: str) -> None:
    config = tmp_path / "kvdiag.yaml"
    config.write_text("targets:\n  - " + json.dumps(url) + "\n")
    with pytest.raises(ConfigError, match=r"kvdiag\.yaml:2: targets\[0\]: .*(spaces or control|port|not a valid host)"):
        serve_settings.load(config)
    sd = tmp_path / "sd.json"
    sd.write_text(json.dumps([{"targets": [url]}]))
    f = FileSD(sd)
    assert not f.refresh() and f.targets == [] and f.error is not None and "\n" not in f.error


def test_the_command_line_keeps_the_exporters_instance_cap(tmp_path: Path) -> None:
    """One exposition claiming thousands of vLLM engines (the issue's had 100,000: inspect ran
    past 45 s normalizing them): refused before any is normalized, as the exporter does."""
    lines = []
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{engine="{i}",model_name="m"}} 0' for i in range(20_000)]
    body = tmp_path / "many.prom"
    body.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "inspect", str(body), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3 and "20000 instances in one exposition (at most 256 are kept)" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "diagnose", str(body), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3 and "20000 instances in one exposition" in json.loads(proc.stdout)["instances"][0]["reason"]
