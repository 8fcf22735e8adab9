"""`--prometheus`: a real Prometheus (Debian package) scraping engines served on loopback.

The test starts Prometheus with a 1 s scrape interval on a temporary config and TSDB, lets it
scrape a few engines (SGLang and vLLM, one with OpenMetrics underscore-escaped names, one
static body, one target that is not an engine), then reads the window back through
query_range and checks that the same adapters give the same numbers and verdicts.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from kvdiag import cli
from kvdiag.engines import normalize_scrape
from kvdiag.model import NUMERIC_FIELDS, Scrape
from kvdiag.refpool.emit import content_type
from kvdiag.sources.prometheus import read_window, series_regex
from kvdiag.engines import READER
from tests.checks.scenario import const, ramp, recording
from tests.conftest import Responder, hang_guard

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
BOTTLENECK = dict(usage=const(0.97), waiting=ramp(5, 1), running=const(48), evictions=const(1), ttft=const(20.0))
SAMPLES_NEEDED = 12

pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="prometheus (Debian package) not installed")


class Sequence:
    """Serves the bodies of a recording one per scrape, then keeps serving the last one."""

    def __init__(self, scrapes: list[Scrape], openmetrics: bool = False) -> None:
        self.bodies = [s.body.encode() for s in scrapes]
        self.i = 0
        self.lock = threading.Lock()
        self.ctype = content_type(openmetrics)

    def __call__(self, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        with self.lock:
            body = self.bodies[min(self.i, len(self.bodies) - 1)]
            self.i += 1
        return 200, {"Content-Type": self.ctype}, body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    from tests.conftest import serve

    static = recording("vllm", steps=1, usage=const(0.6), waiting=const(3), running=const(17), evictions=const(4), ttft=const(0.7))[0]
    servers = {
        "sglang": serve(Responder(Sequence(recording("sglang", steps=200, tp=2, **BOTTLENECK)))),
        "vllm": serve(Responder(Sequence(recording("vllm", steps=200, **BOTTLENECK)))),
        "escaped": serve(Responder(Sequence(recording("sglang", steps=200, openmetrics=True, escape=True, **BOTTLENECK), openmetrics=True))),
        "static": serve(Responder(Sequence([static]))),
        "other": serve(Responder(lambda p, h: (200, {"Content-Type": content_type(False)}, b"# TYPE node_load1 gauge\nnode_load1 0.5\n"))),
    }
    hostport = {k: url.split("://", 1)[1] for k, (_, url) in servers.items()}
    tmp = tmp_path_factory.mktemp("prometheus")
    engines = [hostport[k] for k in ("sglang", "vllm", "escaped", "static")]
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
        "scrape_configs:\n"
        f"  - job_name: engines\n    static_configs:\n      - targets: {json.dumps(engines)}\n"
        f"  - job_name: other\n    static_configs:\n      - targets: {json.dumps([hostport['other']])}\n"
    )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"),
    )  # fmt: skip
    try:
        _wait_for_samples(url, proc, tmp)
        yield {"url": url, "hostport": hostport, "static": static}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for server, _ in servers.values():
            server.shutdown()
            server.server_close()


def _wait_for_samples(url: str, proc: subprocess.Popen, tmp: Path) -> None:
    deadline = time.time() + hang_guard(10)
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited: {(tmp / 'prometheus.log').read_text()[-2000:]}")
        try:
            r = requests.get(f"{url}/api/v1/query", params={"query": "count_over_time(up[1m])"}, timeout=10).json()
            counts = [float(x["value"][1]) for x in r["data"]["result"]]
            if len(counts) == 5 and min(counts) >= SAMPLES_NEEDED:
                return
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.5)
    pytest.fail(f"prometheus did not collect {SAMPLES_NEEDED} scrapes in time: {(tmp / 'prometheus.log').read_text()[-2000:]}")


def test_series_regex_matches_every_stored_spelling() -> None:
    import re

    rx = re.compile(series_regex(READER.wanted))
    for name in ("sglang:token_usage", "sglang_token_usage", "vllm:num_preemptions_total", "vllm_num_preemptions_total",
                 "sglang:time_to_first_token_seconds_bucket", "vllm:cache_config_info"):  # fmt: skip
        assert rx.fullmatch(name), name
    assert not rx.fullmatch("node_load1") and not rx.fullmatch("sglang:token_usage_created")


def test_same_numbers_as_a_direct_scrape(prom: dict) -> None:
    """A static body through Prometheus equals the same body through the adapters directly."""
    res = read_window(prom["url"], '{job="engines"}', since=20, step=1)
    target = prom["hostport"]["static"]
    via_prom = [s for s in res.samples if s.instance.startswith(target)]
    assert len(via_prom) >= 10
    (direct,) = normalize_scrape(Scrape(0.0, target, None, prom["static"].body))
    for s in via_prom:
        assert s.instance == direct.instance and s.engine == "vllm"
        for f in NUMERIC_FIELDS:
            a, b = getattr(s, f), getattr(direct, f)
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-12), f
        assert s.ttft == direct.ttft and s.queue_time == direct.queue_time
        assert set(s.provenance) == set(direct.provenance)


def test_diagnose_from_prometheus(prom: dict, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["diagnose", "--json", "--prometheus", prom["url"], "--selector", '{job="engines"}', "--since", "30s", "--step", "1s", "--window", "20s"])
    out = json.loads(capsys.readouterr().out)
    by = {i["instance"]: i for i in out["instances"]}
    hp = prom["hostport"]
    assert set(by) == {hp["sglang"], hp["vllm"] + " engine=0", hp["escaped"], hp["static"] + " engine=0"}
    for key in (hp["sglang"], hp["vllm"] + " engine=0", hp["escaped"]):
        inst = by[key]
        assert inst["verdict"] == "l1_kv_bottleneck", (key, inst["reason"])
        ev = inst["checks"]["evictions_growing"]["evidence"]
        assert ev["span"]["samples"] >= 10 and ev["increase"] >= 8  # one eviction per scrape, TP ranks not doubled
    assert by[hp["escaped"]]["engine"] == "sglang"
    stored = requests.get(f"{prom['url']}/api/v1/series", params={"match[]": f'{{instance="{hp["escaped"]}"}}'}, timeout=5).json()
    names = {s["__name__"] for s in stored["data"]}
    assert "sglang_token_usage" in names and "sglang:token_usage" not in names  # stored escaped, read back all the same
    assert by[hp["static"] + " engine=0"]["verdict"] == "healthy"
    assert code == 2


def test_target_without_engine_metrics_is_named(prom: dict) -> None:
    res = read_window(prom["url"], 'job="other"', since=20, step=1)
    assert res.samples == []
    (why,) = res.problems.values()
    assert "serves none of the engine metrics" in why and "--enable-metrics" in why
    assert list(res.problems) == [prom["hostport"]["other"]]


def test_prometheus_errors_are_reported(prom: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["diagnose", "--prometheus", prom["url"], "--selector", '{job=~"("}', "--since", "10s"]) == 3
    assert "bad_data" in capsys.readouterr().err
    assert cli.main(["diagnose", "--prometheus", f"http://127.0.0.1:{_free_port()}", "--since", "10s", "--timeout", "1"]) == 3
    assert "ConnectionError" in capsys.readouterr().err


def test_selector_and_step_helpers() -> None:
    from kvdiag.sources.prometheus import default_step, matchers

    assert matchers('{job="a", env=~"p.*"}') == 'job="a", env=~"p.*"'
    assert matchers('job="a"') == 'job="a"' and matchers("") == ""
    with pytest.raises(ValueError, match="label matchers only"):
        matchers('up{job="a"}')
    assert default_step(3600) == 5 and default_step(10) == 1
    with pytest.raises(ValueError, match="raise --step"):
        read_window("http://127.0.0.1:9", since=86400 * 30, step=1)
