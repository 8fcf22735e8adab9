"""The rules are the checks: the committed rules, run by promtool over every scenario recording,
give the same check statuses and the same verdict as the Python checks at every 15 s step.

Every scenario of the catalogue runs on both reference engines; at each 15 s scrape its
exposition is rendered in every dialect of that engine (release name variants, legacy series,
counters an old release lacks). Each (scenario, engine, dialect) recording becomes one promtool
test group: its series are the input (one sample per scrape; a series that leaves the exposition
gets a staleness marker, as a scrape writes), the rules are evaluated every 15 s, and at every
step two queries are compared with what the Python checks answer for the window ending at the
same scrape: each check's status per instance (1 firing, 0 ok, absent unknown) and the verdict
alert that holds there (pending or firing; none for healthy or an idle instance).

The steps start at the second scrape: a single exposition is a point-in-time answer in Python
(lifetime counters) and nothing in PromQL, where every rate needs two samples.

All groups go to one ``promtool test rules`` run. What it adds to CI: the catalogue's
simulations (~30-40 s of CPU, shared with the other tests that judge the catalogue:
``tests/scenario_recordings.py``), the Python checks at each step and the promtool run.
"""

from __future__ import annotations

import json
import math
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.checks import recent, run_checks
from kvdiag.checks.catalog import VERDICTS
from kvdiag.checks.verdict import decide
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Scrape
from kvdiag.refpool.emit import content_type
from kvdiag.refpool.scenarios import ENGINES, SCENARIOS
from kvdiag.refpool.sim import EPOCH
from kvdiag.render import RULES_ALERTS, RULES_RECORDING
from kvdiag.render.rules import groups as rule_groups
from kvdiag.window import Window
from tests.mixin.conftest import ROOT, need
from tests.mixin.test_promtool import _without_annotations
from tests.scenario_recordings import INTERVAL, Recording, dialects

VERDICT_ALERTS = "|".join(v.alert for v in VERDICTS.values() if v.alert)
STATUS_QUERY = "sum by (check, engine, dp_rank) (instance:kvdiag_check:status)"
VERDICT_QUERY = f'group by (alertname, engine, dp_rank) (ALERTS{{alertname=~"{VERDICT_ALERTS}"}})'
CONFIG = Config()


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _series_string(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"


def input_series(rec: Recording, target: dict[str, str]) -> list[dict[str, str]]:
    """The recording as promtool input: one value per scrape, ``stale`` where a series left."""
    values: dict[str, list[str | None]] = {}
    for i, body in enumerate(rec.bodies):
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                key = _series_string(s.name, {**s.labels, **target})
                values.setdefault(key, [None] * len(rec.bodies))[i] = _value(s.value)
    out = []
    for key, vals in values.items():
        cells, seen = [], False
        for v in vals:
            if v is None:
                cells.append("stale" if seen else "_")
                seen = False
            else:
                cells.append(v)
                seen = True
        out.append({"series": key, "values": " ".join(cells)})
    return out


def _labels(extra: dict[str, str], sample: PoolSample) -> str:
    split = {k: v for k, v in sample.labels.items() if k in ("engine", "dp_rank")}
    return "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted({**extra, **split}.items())) + "}"


def expectations(rec: Recording, target: str) -> list[dict]:
    """The Python checks' answers at every step (from the second scrape), as promql_expr_tests."""
    by_instance: dict[str, list[PoolSample]] = {}
    steps: list[list[PoolSample]] = []
    for i, body in enumerate(rec.bodies):
        scrape = Scrape(EPOCH + (i + 1) * INTERVAL, target, content_type(False), body)
        got = normalize_scrape(scrape, rec.engine)
        for s in got:
            by_instance.setdefault(s.instance, []).append(s)
        steps.append(got)
    tests = []
    for i in range(1, len(rec.bodies)):
        status, verdicts = [], []
        for s in steps[i]:
            history = [x for x in by_instance[s.instance] if x.ts <= s.ts]
            checks = run_checks(recent(Window(s.instance, history), CONFIG), CONFIG)  # what diagnose() decides on
            for check, res in checks.items():
                if res.status != "unknown":
                    status.append({"labels": _labels({"check": check}, s), "value": 1 if res.status == "firing" else 0})
            alert = VERDICTS[decide(checks, CONFIG).name].alert
            idle = (s.running or 0) + (s.waiting or 0) == 0
            if alert and not idle:
                verdicts.append({"labels": _labels({"alertname": alert}, s), "value": 1})
        at = f"{int(i * INTERVAL)}s"
        tests.append({"expr": STATUS_QUERY, "eval_time": at, "exp_samples": status})
        tests.append({"expr": VERDICT_QUERY, "eval_time": at, "exp_samples": verdicts})
    return tests


def _group(rec: Recording) -> dict:
    target = {"job": "kvdiag-diff", "instance": "engine:8000"}
    return {
        "name": rec.name,
        "interval": f"{int(INTERVAL)}s",
        "input_series": input_series(rec, target),
        "promql_expr_test": expectations(rec, "http://engine:8000"),
    }


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory, scenario_recordings: list[Recording]) -> Path:
    tmp = tmp_path_factory.mktemp("differential")
    with ProcessPoolExecutor(max_workers=2) as pool:
        groups = list(pool.map(_group, scenario_recordings, chunksize=4))
    alerts = _without_annotations(ROOT / RULES_ALERTS, tmp / "alerts.yaml")
    doc = {
        "rule_files": [str(ROOT / RULES_RECORDING), str(alerts)],
        "evaluation_interval": f"{int(INTERVAL)}s",
        "group_eval_order": rule_groups(),
        "tests": groups,
    }
    path = tmp / "differential.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=100_000))
    return path


def test_the_suite_covers_every_scenario_engine_and_dialect(suite: Path) -> None:
    doc = yaml.safe_load(suite.read_text())
    names = {g["name"] for g in doc["tests"]}
    assert names == {f"{s} {e} {d}" for s in SCENARIOS for e in ENGINES for d in dialects(s, e)}
    assert len(names) == 2 * 4 * len(SCENARIOS) - 1  # vLLM V0 serves no DP engines
    steps = [t for g in doc["tests"] for t in g["promql_expr_test"]]
    assert len(steps) > 2000
    # the Python side sees every verdict the catalogue tells, so the comparison is not vacuous
    alerts = {json.loads(json.dumps(s["labels"])).split('alertname="')[1].split('"')[0]
              for t in steps if t["expr"] == VERDICT_QUERY for s in t["exp_samples"]}  # fmt: skip
    assert {"KvdiagL1KVPoolBottleneck", "KvdiagL1KVPoolPressure", "KvdiagQueueWithoutKVPressure", "KvdiagKVPoolNearCapacity"} <= alerts


def test_rules_equal_python_checks_at_every_step(suite: Path) -> None:
    promtool = need("promtool")
    out = subprocess.run([promtool, "test", "rules", str(suite)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-12000:] + out.stderr[-2000:]
