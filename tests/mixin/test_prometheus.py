"""The committed rules and dashboards on a real Prometheus, scraping simulated engines.

One Prometheus for the module (1 s scrape and evaluation interval, the rules rendered for that
interval: ``kvdiag render --interval 1s``, and the rendered keep-list on every job, so the
rules are seen to need nothing it drops) scrapes every story of
``stories.STORIES`` (SGLang and vLLM, several dialects, TP-rank duplicates, DP engines,
underscore-escaped names, legacy vLLM names, an idle engine, an SGLang without the retraction
counter) plus a stand-in for the kvdiag exporter's ``kvdiag_verdict``/``kvdiag_check_status``.
What each server served is also kept, byte for byte, for the Python checks: the parity test
requires the same verdict from both.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Iterator

import pytest
import yaml

from kvdiag.checks import diagnose
from kvdiag.checks.catalog import FINDINGS, VERDICTS
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import Diagnosis, Scrape
from kvdiag.refpool.emit import content_type
from kvdiag.refpool.serve import MetricsServer
from kvdiag.render import GRAFANA_ALERTS, KEEP_LIST, RULES_ALERTS, RULES_RECORDING, RUNBOOKS, render_all
from kvdiag.render.dashboards import picked
from kvdiag.render.promql import INSTANCE_INFO, Labels
from kvdiag.render.rules import groups as rule_groups
from kvdiag.window import windows
from tests.conftest import hang_guard
from tests.mixin.conftest import ROOT, need
from tests.mixin.prom import Prometheus
from tests.mixin.stories import STORIES, Story

CONFIG = Config()
ALERT_TO_VERDICT = {v.alert: v.name for v in VERDICTS.values() if v.alert}
ALERT_TO_FINDING = {f.alert: f.name for f in FINDINGS.values() if f.alert}
EXPORTER_BODY = (
    "# TYPE kvdiag_verdict gauge\n"
    'kvdiag_verdict{engine="sglang",instance="http://127.0.0.1:1",model="m",verdict="l1_kv_bottleneck"} 1\n'
    'kvdiag_verdict{engine="sglang",instance="http://127.0.0.1:1",model="m",verdict="healthy"} 0\n'
    "# TYPE kvdiag_check_status gauge\n"
    'kvdiag_check_status{check="kv_usage_saturated",engine="sglang",instance="http://127.0.0.1:1",model="m"} 1\n'
)


@dataclass
class Served:
    """One story on loopback, and every body it served (what Prometheus scraped)."""

    story: Story
    server: MetricsServer
    scrapes: list[Scrape] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class World:
    prom: Prometheus
    served: dict[str, Served]


def _verdicts_from_alerts(prom: Prometheus) -> dict[tuple[str, str, str], tuple[str, set[str]]]:
    """(job, engine, dp_rank) -> (verdict, findings) from ALERTS (pending or firing: the
    condition holds now; ``for:`` only delays notification)."""
    out: dict[tuple[str, str, str], tuple[str, set[str]]] = {}
    for s in prom.query('group by (job, engine, dp_rank) (instance:kvdiag_instance:info)'):
        m = s["metric"]
        out[(m["job"], m.get("engine", ""), m.get("dp_rank", ""))] = ("healthy", set())
    for a in prom.query('ALERTS{alertname=~"Kvdiag.*"}'):
        m = a["metric"]
        key = (m.get("job", ""), m.get("engine", ""), m.get("dp_rank", ""))
        verdict, found = out.get(key, ("healthy", set()))
        if m["alertname"] in ALERT_TO_VERDICT:
            verdict = ALERT_TO_VERDICT[m["alertname"]]
        else:
            found = found | {ALERT_TO_FINDING[m["alertname"]]}
        out[key] = (verdict, found)
    return out


def _expected() -> dict[tuple[str, str, str], tuple[str, set[str]]]:
    out = {}
    for story in STORIES:
        split = "engine" if story.engine == "vllm" else "dp_rank"
        for i, verdict in enumerate(story.expected):
            found = set(story.findings[i]) if story.findings else set()
            dp = str(i) if (len(story.engines) > 1 or split == "engine") else ""
            key = (story.name, dp if split == "engine" else "", dp if split == "dp_rank" else "")
            out[key] = (verdict, found)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    binary = need("prometheus")
    t0 = time.time()
    served: dict[str, Served] = {}
    for story in STORIES:

        def answer(openmetrics: bool, story: Story = story) -> tuple[str, str]:
            now = time.time()
            body, ctype = story.body(now - t0, openmetrics), content_type(openmetrics)
            with served[story.name].lock:
                served[story.name].scrapes.append(Scrape(now, served[story.name].server.url, ctype, body))
            return body, ctype

        served[story.name] = Served(story, MetricsServer(answer))
    exporter = MetricsServer(lambda om: (EXPORTER_BODY, "text/plain; version=0.0.4; charset=utf-8"))
    for s in list(served.values()):
        s.server.start()
    exporter.start()
    jobs = {name: s.server.url for name, s in served.items()} | {"kvdiag": exporter.url}
    rules_dir = tmp_path_factory.mktemp("rules")
    rendered = render_all(interval=1.0)
    for name in (RULES_RECORDING, RULES_ALERTS):
        (rules_dir / Path(name).name).write_text(rendered[name])
    keep = yaml.safe_load(rendered[KEEP_LIST])["metric_relabel_configs"]
    prom = Prometheus(binary, tmp_path_factory.mktemp("prometheus"),
                      [rules_dir / Path(RULES_RECORDING).name, rules_dir / Path(RULES_ALERTS).name], jobs, keep)
    try:
        prom.start()
        expected = _expected()

        def settled() -> bool:
            return _verdicts_from_alerts(prom) == expected

        try:
            prom.wait(settled, hang_guard(30), "every story's verdict in ALERTS", every=2)
        except AssertionError as exc:
            got = _verdicts_from_alerts(prom)
            diff = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
            raise AssertionError(f"{exc}; (got, expected) where they differ: {diff}\n{prom.logs()}") from None
        yield World(prom, served)
    finally:
        prom.stop()
        for s in served.values():
            s.server.stop()
        exporter.stop()


def test_rules_load_and_evaluate_without_errors(world: World) -> None:
    groups = world.prom.api("rules")["groups"]
    assert sorted(g["name"] for g in groups) == sorted(rule_groups())
    assert {g["interval"] for g in groups} == {1}
    bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r.get("health") != "ok"]
    assert not bad


def test_the_keep_list_drops_the_families_the_rules_do_not_read(world: World) -> None:
    """The stories serve families no rule reads (latency histograms, throughput gauges...):
    none is stored, while every verdict still comes out (the fixture waited for them)."""
    keep = re.compile(yaml.safe_load(render_all()[KEEP_LIST])["metric_relabel_configs"][0]["regex"])
    served = set()
    for s in world.served.values():
        with s.lock:
            body = s.scrapes[-1].body
        served |= {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")}
    dropped = {name for name in served if not keep.fullmatch(name)}
    assert dropped, "every family served is kept: the test would show nothing"
    stored = {s["metric"]["__name__"] for s in world.prom.query('count by (__name__) ({__name__=~"(sglang|vllm).+"})')}
    assert stored and not stored & dropped, sorted(stored & dropped)


def test_escaped_names_are_stored_as_escaped_and_read(world: World) -> None:
    """prometheus_client >= 0.23 writes sglang_* samples to Prometheus 2.x; the rules read both."""
    job = "sglang-bottleneck-tp2-escaped"
    assert world.prom.query(f'sglang_token_usage{{job="{job}"}}'), "escaped spelling not stored"
    assert not world.prom.query(f'{{__name__="sglang:token_usage", job="{job}"}}')
    usage = world.prom.query(f'instance:kvdiag_kv_usage:ratio{{job="{job}"}}')
    assert [float(s["value"][1]) for s in usage] == [0.99]  # one series: TP ranks collapsed


def test_dp_engines_kept_apart_and_server_wide_series_copied(world: World) -> None:
    usage = {s["metric"]["dp_rank"]: float(s["value"][1]) for s in world.prom.query('instance:kvdiag_kv_usage:ratio{job="sglang-dp2"}')}
    assert usage == {"0": 0.97, "1": 0.5}
    ttft = world.prom.query('instance:kvdiag_ttft_seconds:p99_5m{job="sglang-dp2"}')
    assert sorted(s["metric"]["dp_rank"] for s in ttft) == ["0", "1"]  # tokenizer TTFT on both engines
    vllm = {s["metric"]["engine"] for s in world.prom.query('instance:kvdiag_kv_capacity:tokens{job="vllm-dp2"}')}
    assert vllm == {"0", "1"}


def test_vllm_capacity_from_cache_config_info_labels(world: World) -> None:
    """kv_cache_size_tokens (0.33) and (num_gpu_blocks / DP engines - 1) x block_size (0.8)."""
    for job in ("vllm-dp2", "vllm-legacy-0.8"):
        values = {float(s["value"][1]) for s in world.prom.query(f'instance:kvdiag_kv_capacity:tokens{{job="{job}"}}')}
        assert values == {100_000.0}, job


def test_prometheus_and_python_checks_give_the_same_verdict(world: World) -> None:
    """Parity: the bodies Prometheus scraped, through the adapters and the Python checks."""
    prom = _verdicts_from_alerts(world.prom)
    python = {key: (d.verdict.name, {f.name for f in d.findings if FINDINGS[f.name].alert}) for key, d in _python(world).items()}
    assert python == prom
    assert python == _expected()


def _python(world: World) -> dict[tuple[str, str, str], Diagnosis]:
    """The Python diagnosis of every instance, from the bodies Prometheus scraped, keyed by
    (job, vLLM engine, SGLang dp_rank) like the recorded series."""
    out = {}
    for name, served in world.served.items():
        with served.lock:
            scrapes = list(served.scrapes)
        samples = [ps for sc in scrapes for ps in normalize_scrape(sc)]
        for window in windows(samples, CONFIG.window).values():
            labels = window.last.labels
            out[(name, labels.get("engine", ""), labels.get("dp_rank", ""))] = diagnose(window, CONFIG)
    return out


def test_idle_engine_never_alerts(world: World) -> None:
    assert not world.prom.query('ALERTS{job="vllm-idle"}')
    # its series are all there (absent is not zero): the quiet is the verdict, not missing data
    assert world.prom.query('instance:kvdiag_check:status{job="vllm-idle", check="evictions_growing"}')


def _dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel, expr) for every panel target of the committed JSON."""
    out = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        d = json.loads(path.read_text())
        for p in d["panels"]:
            for t in p["targets"]:
                out.append((d["title"], p["title"], t["expr"]))
    return out


def _substitute(expr: str, instance: str = ".*") -> str:
    """A panel's query as Grafana sends it: every instance selected (``.*``, the variables'
    "All"), or one picked instance (its address, regex-escaped as Grafana writes it)."""
    return re.sub(r"\$(job|model)\b", ".*", expr).replace("$instance", instance)


def test_every_dashboard_panel_query_answers_with_data(world: World) -> None:
    """With every instance selected, every fleet panel answers; the per-instance panels answer
    once an instance is picked, and stay empty for "All" (no series per instance for a fleet)."""
    # Grafana escapes a picked value for a regex inside a PromQL string: 127\\.0\\.0\\.1:port
    picks = sorted({re.escape(s["metric"]["instance"]).replace("\\", "\\\\") for s in world.prom.query(INSTANCE_INFO)})
    queries = _dashboard_queries()
    per_instance = [q for q in queries if picked(Labels()) in q[2]]
    assert per_instance and len(per_instance) < len(queries)

    def answers(expr: str, is_per_instance: bool) -> bool:
        """With every instance selected, or (a per-instance panel) with some one instance picked."""
        return any(world.prom.query(_substitute(expr, one)) for one in (picks if is_per_instance else [".*"]))

    empty = [f"{dash} / {panel}: {expr}" for dash, panel, expr in queries if not answers(expr, (dash, panel, expr) in per_instance)]
    assert not empty, "panel queries without data:\n" + "\n".join(empty)
    shown = [f"{dash} / {panel}" for dash, panel, expr in per_instance if world.prom.query(_substitute(expr))]
    assert not shown, f"per-instance series drawn with every instance selected: {shown}"


def test_dashboard_variables_resolve(world: World) -> None:
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
            assert m, var["definition"]
            values = world.prom.api(f"label/{m.group(2)}/values", **{"match[]": _substitute(m.group(1))})
            assert values, f"{path.name}: variable {var['name']} has no values"


def test_grafana_alert_queries_run_on_prometheus(world: World) -> None:
    """The Grafana-managed rules' instant queries evaluate, and find the bottleneck instances."""
    doc = yaml.safe_load((ROOT / GRAFANA_ALERTS).read_text())
    found = {}
    for rule in doc["groups"][0]["rules"]:
        found[rule["title"]] = world.prom.query(rule["data"][0]["model"]["expr"])
    jobs = {s["metric"].get("job") for s in found["KvdiagL1KVPoolBottleneck"]}
    assert jobs == {"sglang-bottleneck-tp2-escaped", "vllm-dp2"}
    assert all(float(s["value"][1]) == 1 for series in found.values() for s in series)


def test_alert_annotations_expand_with_values_and_link_to_runbook_sections(world: World) -> None:
    runbooks = (ROOT / RUNBOOKS).read_text()
    anchors = {h[3:].strip().lower() for h in runbooks.splitlines() if h.startswith("## ")}
    alerts = world.prom.api("alerts")["alerts"]
    assert alerts
    for a in alerts:
        ann = a["annotations"]
        assert "error" not in ann["description"].lower(), ann["description"]
        assert a["labels"]["instance"] in ann["description"]
        if a["labels"]["alertname"] in ("KvdiagL1KVPoolBottleneck", "KvdiagL1KVPoolPressure"):
            # the alert's own value: the KV usage admission counts, as a percentage
            assert re.search(r"Now: KV usage with the next admission's need [0-9.]+%\.$", ann["description"]), ann["description"]
        if a["labels"]["alertname"] == "KvdiagCacheHealthyButTTFTBad":
            assert re.search(r"Now: P99 TTFT [0-9.]+s\.$", ann["description"]), ann["description"]
        assert ann["runbook_url"].split("#", 1)[1] in anchors
        assert f"var-instance={a['labels']['instance']}" in ann["dashboard_url"].replace("%3A", ":")


def test_check_statuses_agree_with_python(world: World) -> None:
    """Each check's firing / ok / unknown, per instance, from the rules and from Python."""
    prom: dict[tuple[str, str, str, str], str] = {}
    for s in world.prom.query("instance:kvdiag_check:status"):
        m = s["metric"]
        prom[(m["job"], m.get("engine", ""), m.get("dp_rank", ""), m["check"])] = "firing" if s["value"][1] == "1" else "ok"
    python = {
        (*key, check): result.status
        for key, d in _python(world).items()
        for check, result in d.checks.items()
        if result.status != "unknown"
    }
    diff = {k: (prom.get(k), python.get(k)) for k in set(prom) | set(python) if prom.get(k) != python.get(k)}
    assert not diff, diff


def test_admission_usage_agrees_with_python(world: World) -> None:
    """The recorded admission usage equals the figure the Python S check judged, per instance:
    usage + (uncached prompt [+ output x (1 + reserve x running)]) / capacity, or usage."""
    prom = {
        (s["metric"]["job"], s["metric"].get("engine", ""), s["metric"].get("dp_rank", "")): float(s["value"][1])
        for s in world.prom.query("instance:kvdiag_kv_admission_usage:ratio5m")
    }
    python = {
        key: value
        for key, d in _python(world).items()
        if isinstance(value := d.checks["kv_usage_saturated"].evidence.values.get("admission_usage_last"), float)
    }
    assert set(prom) == set(python)
    assert python[("sglang-admission-reserve", "", "")] == 1.0  # 0.93 + 48 x 0.7 x 500 + ... tokens: full
    assert python[("sglang-dp2", "", "1")] > 0.5  # the reserve counts below a pinned pool too
    off = {k: (prom[k], python[k]) for k in prom if abs(prom[k] - python[k]) > 0.005}
    assert not off, off
