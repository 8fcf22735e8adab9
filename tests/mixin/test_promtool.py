"""promtool on the committed rules: ``check rules``, and ``test rules`` unit tests.

The unit tests are built here from ``CASES``: for each case, SGLang or vLLM input series (15 s
apart, 20 minutes) and the alerts expected at the end, with every one of the six alerts
checked in every case (so each is seen firing and not firing). Cases cover both engines,
TP-rank duplicates, DP engines, ``sglang_`` escaped names, legacy vLLM names, a counter reset
(engine restart), an idle engine, a stale pinned gauge on an idle engine, and no engine at all.

promtool compares annotations verbatim; the alerts are tested here for firing, labels and
``for:``, with the annotations left out of the copy under test. The annotation templates are
expanded, with values, by the real Prometheus in ``test_prometheus.py``.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvdiag.render import RULES_ALERTS, RULES_RECORDING
from kvdiag.render.rules import groups as rule_groups
from tests.conftest import EXPECTED_ALERTS
from tests.mixin.conftest import ROOT, need

ALERTS = tuple(EXPECTED_ALERTS)
SEVERITY = EXPECTED_ALERTS
MODEL = "llama"
STEPS = 80  # samples 15 s apart: 20 minutes
EVAL = "19m"


@dataclass(frozen=True)
class Eng:
    """One engine instance's input, as promtool expanding notation (``a+bxN``)."""

    usage: str = "0.3"
    running: str = "20"
    waiting: str = "0"
    evictions: str | None = "0"  # None: the counter is absent
    slow_ttft: bool = False  # first tokens land between 10 s and 20 s (above the 10 s SLO)
    requests: str = f"0+2x{STEPS}"  # cumulative first tokens
    legacy: bool = False  # old names: vLLM gpu_*; SGLang 0.5.3 (no retraction counter)


BUSY = Eng()
SATURATED = Eng(usage="0.99", running="48", waiting=f"0+2x{STEPS}", evictions=f"0+1x{STEPS}", slow_ttft=True)


@dataclass(frozen=True)
class Case:
    name: str
    engine: str  # sglang | vllm
    engines: tuple[Eng, ...]  # DP engines (one unless DP)
    fires: tuple[tuple[str, int], ...]  # (alert, DP index) expected at EVAL
    tp: int = 1
    escaped: bool = False
    dp: bool = False


def _labels(d: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(d.items())) + "}"


def _sglang(case: Case, i: int, e: Eng) -> list[tuple[str, dict[str, str], str]]:
    """(name, labels, values) of one SGLang DP engine (+ the server's tokenizer series once)."""
    p = "sglang_" if case.escaped else "sglang:"
    out = []
    for rank in range(case.tp):
        sched = {"model_name": MODEL, "engine_type": "unified", "tp_rank": str(rank), "pp_rank": "0"}
        if case.dp:
            sched["dp_rank"] = str(i)
        out += [
            (p + "token_usage", sched, f"{e.usage}x{STEPS}"),
            (p + "num_running_reqs", sched, f"{e.running}x{STEPS}"),
            (p + "num_queue_reqs", sched, e.waiting if "x" in e.waiting else f"{e.waiting}x{STEPS}"),
        ]
        if not e.legacy:
            out.append((p + "full_token_usage", sched, f"{e.usage}x{STEPS}"))
            if e.evictions is not None:
                out.append((p + "num_retracted_requests_total", sched, _counter(e.evictions)))
        out.append((p + "num_retracted_reqs", {**sched, "pid": str(100 + rank)}, f"2x{STEPS}"))  # never read
    if i == 0:
        tok = {"model_name": MODEL, "engine_type": "unified", "is_streaming": "true"}
        out += _ttft(p, tok, case.engines, "0.1")
        out += [
            (p + "prompt_tokens_total", tok, f"0+{1000 * len(case.engines)}x{STEPS}"),
            (p + "cached_tokens_total", {**tok, "cache_source": "device"}, f"0+{800 * len(case.engines)}x{STEPS}"),
        ]
    return out


def _vllm(case: Case, i: int, e: Eng) -> list[tuple[str, dict[str, str], str]]:
    p = "vllm:"
    lab = {"model_name": MODEL, "engine": str(i)}
    usage = p + ("gpu_cache_usage_perc" if e.legacy else "kv_cache_usage_perc")
    prefix = p + ("gpu_prefix_cache_" if e.legacy else "prefix_cache_")
    return [
        (usage, lab, f"{e.usage}x{STEPS}"),
        (p + "num_requests_running", lab, f"{e.running}x{STEPS}"),
        (p + "num_requests_waiting", lab, e.waiting if "x" in e.waiting else f"{e.waiting}x{STEPS}"),
        (p + "num_preemptions_total", lab, _counter(e.evictions or "0")),
        (prefix + "queries_total", lab, f"0+1000x{STEPS}"),
        (prefix + "hits_total", lab, f"0+800x{STEPS}"),
    ] + _ttft(p, lab, (e,), "0.1")


def _ttft(p: str, labels: dict[str, str], engines: tuple[Eng, ...], fast: str) -> list[tuple[str, dict[str, str], str]]:
    """A TTFT histogram: all first tokens under ``fast`` seconds, or between 10 and 20 s."""
    slow = any(e.slow_ttft for e in engines)
    reqs = engines[0].requests
    none = f"0x{STEPS}"
    buckets = {fast: none if slow else reqs, "10": none if slow else reqs, "20": reqs, "+Inf": reqs}
    name = p + "time_to_first_token_seconds"
    out = [(name + "_bucket", {**labels, "le": le}, v) for le, v in buckets.items()]
    return out + [(name + "_count", labels, reqs)]


def _counter(values: str) -> str:
    return values if "x" in values or " " in values else f"{values}x{STEPS}"


CASES = (
    Case("sglang bottleneck, TP-rank duplicates", "sglang", (SATURATED,),
         (("KvdiagL1KVPoolBottleneck", 0), ("KvdiagCacheHealthyButTTFTBad", 0)), tp=2),
    Case("sglang escaped names: pressure (pinned + evictions, no queue)", "sglang",
         (Eng(usage="0.99", running="48", evictions=f"0+1x{STEPS}"),), (("KvdiagL1KVPoolPressure", 0),), escaped=True),
    Case("sglang DP: near capacity on one engine, queue without KV pressure on the other", "sglang",
         (Eng(usage="0.97", running="48", evictions=None), Eng(usage="0.5", waiting=f"0+2x{STEPS}", evictions=None)),
         (("KvdiagKVPoolNearCapacity", 0), ("KvdiagQueueWithoutKVPressure", 1)), dp=True),
    # pinned and queued with evictions unknown: every reading of them names the pool, so the
    # least of those verdicts (issue 28), not unknown
    Case("sglang 0.5.3 without the retraction counter: pressure", "sglang",
         (Eng(usage="0.99", running="48", waiting=f"0+2x{STEPS}", legacy=True),), (("KvdiagL1KVPoolPressure", 0),)),
    Case("sglang 0.5.3 idle without the retraction counter: healthy, no alert", "sglang",
         (Eng(usage="0", running="0", requests=f"0x{STEPS}", legacy=True),), ()),
    Case("vllm DP: bottleneck and a slow, cache-healthy engine 0; engine 1 fine", "vllm", (SATURATED, BUSY),
         (("KvdiagL1KVPoolBottleneck", 0), ("KvdiagCacheHealthyButTTFTBad", 0))),
    Case("vllm legacy gpu_* names: queue without KV pressure", "vllm",
         (Eng(usage="0.4", waiting=f"0+2x{STEPS}", legacy=True),), (("KvdiagQueueWithoutKVPressure", 0),)),
    Case("vllm restart: the preemption counter resets, no false evictions", "vllm",
         (Eng(usage="0.99", running="48", evictions=f"50x{STEPS - 12} 0x11"),), (("KvdiagKVPoolNearCapacity", 0),)),
    Case("vllm cache healthy, TTFT bad, pool fine", "vllm", (Eng(slow_ttft=True),), (("KvdiagCacheHealthyButTTFTBad", 0),)),
    Case("vllm idle engine", "vllm", (Eng(usage="0", running="0", requests=f"0x{STEPS}"),), ()),
    Case("vllm idle engine with a stale pinned usage gauge", "vllm", (Eng(usage="0.99", running="0", requests=f"0x{STEPS}"),), ()),
    Case("no engine metrics at all", "vllm", (), (("KvdiagEngineMetricsAbsent", -1),)),
)


def _test(case: Case) -> dict:
    job, instance = case.engine, f"{case.engine}-0:8000"
    target = {"job": job, "instance": instance}
    series = []
    for i, e in enumerate(case.engines):
        rows = (_sglang if case.engine == "sglang" else _vllm)(case, i, e)
        series += [{"series": name + _labels({**target, **lab}), "values": values} for name, lab, values in rows]
    tests = []
    for alert in ALERTS:
        exp = []
        for name, i in case.fires:
            if name != alert:
                continue
            labels = {"severity": SEVERITY[alert]}
            if i >= 0:
                labels |= {**target, "model_name": MODEL}
                if case.engine == "vllm":
                    labels["engine"] = str(i)
                elif case.dp:
                    labels["dp_rank"] = str(i)
            exp.append({"exp_labels": labels})
        tests.append({"eval_time": EVAL, "alertname": alert, "exp_alerts": exp})
    return {"name": case.name, "interval": "15s", "input_series": series, "alert_rule_test": tests}


def _without_annotations(src: Path, dst: Path) -> Path:
    doc = yaml.safe_load(src.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    dst.write_text(yaml.safe_dump(doc, sort_keys=False, width=100_000))
    return dst


def test_promtool_check_rules() -> None:
    promtool = need("promtool")
    out = subprocess.run([promtool, "check", "rules", str(ROOT / RULES_RECORDING), str(ROOT / RULES_ALERTS)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout  # the alerts


@pytest.fixture(scope="module")
def unit_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("promtool")
    alerts = _without_annotations(ROOT / RULES_ALERTS, tmp / "alerts.yaml")
    doc = {
        "rule_files": [str(ROOT / RULES_RECORDING), str(alerts)],
        "evaluation_interval": "15s",
        "group_eval_order": rule_groups(),
        "tests": [_test(c) for c in CASES],
    }
    path = tmp / "kvdiag-tests.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=100_000))
    return path


def test_every_alert_is_seen_firing_and_not_firing() -> None:
    fired = {name for c in CASES for name, _ in c.fires}
    assert fired == set(ALERTS)
    for alert in ALERTS:
        assert any(alert not in {n for n, _ in c.fires} for c in CASES)


def test_promtool_test_rules(unit_tests: Path) -> None:
    promtool = need("promtool")
    out = subprocess.run([promtool, "test", "rules", str(unit_tests)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
