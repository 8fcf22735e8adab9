"""Impossible and non-finite values: absent with the reason, never a crash, never a figure.

Each case is one real engine fixture with one value replaced by something the text format
allows but no engine can mean (a pool of +Inf tokens, NaN in a bucket, a negative counter),
run through the whole path a user runs: reader, adapter, window, checks, ``--json``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from kvdiag import cli
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Provenance, Scrape
from kvdiag.report.json import dumps
from kvdiag.server.ring import Ring
from kvdiag.server.state import InstanceState
from kvdiag.window import Window, counter_increase, counter_step, count_resets
from tests.conftest import SGLANG_FIXTURE, VLLM_FIXTURE, shared_fixture
from tests.server.conftest import raw_server, start_loop  # noqa: F401 (fixtures)

T = "http://10.0.0.1:8000"


def _fixture(name: str) -> str:
    return shared_fixture(name).read_text()


def _replace(text: str, sample: str, value: str) -> str:
    """The fixture with the value of the first sample line starting with ``sample`` replaced."""
    labels = r"[^}\n]*\}" if "{" in sample else r"(?:\{[^}\n]*\})?"
    out, n = re.subn(r"^(" + re.escape(sample) + labels + r") \S+$", lambda m: f"{m.group(1)} {value}", text, count=1, flags=re.M)
    assert n == 1, sample
    return out


def _one(body: str, ts: float = 100.0) -> PoolSample:
    [s] = normalize_scrape(Scrape(ts, T, None, body))
    return s


def strict_loads(text: str) -> object:
    """json.loads that refuses NaN / Infinity as strict parsers (and browsers) do."""

    def refuse(const: str) -> object:
        raise ValueError(f"non-standard JSON constant {const}")

    return json.loads(text, parse_constant=refuse)


# (fixture, sample line, value written, field that must become absent)
CASES = [
    (SGLANG_FIXTURE, "sglang:max_total_num_tokens", "+Inf", "capacity_tokens"),
    (SGLANG_FIXTURE, "sglang:max_total_num_tokens", "1e308", "capacity_tokens"),
    (SGLANG_FIXTURE, "sglang:max_total_num_tokens", "4.9e-324", "capacity_tokens"),
    (SGLANG_FIXTURE, "sglang:kv_evictable_tokens", "-Inf", "evictable_tokens"),
    (SGLANG_FIXTURE, "sglang:token_usage", "1.5", "usage_ratio"),
    (SGLANG_FIXTURE, "sglang:num_queue_reqs", "-3", "waiting"),
    (SGLANG_FIXTURE, "sglang:num_retracted_requests_total", "-5", "evictions_total"),
    (VLLM_FIXTURE, "vllm:prompt_tokens_total", "+Inf", "prompt_tokens_total"),
    (VLLM_FIXTURE, "vllm:num_preemptions_total", "-1", "evictions_total"),
    (VLLM_FIXTURE, "vllm:kv_cache_usage_perc", "+Inf", "usage_ratio"),
    (VLLM_FIXTURE, "vllm:prefix_cache_hits_total", "1e16", "prefix_hit_tokens_total"),
]


@pytest.mark.parametrize("fixture, sample, value, field", CASES)
def test_impossible_value_is_absent_invalid_and_noted(fixture: str, sample: str, value: str, field: str) -> None:
    s = _one(_replace(_fixture(fixture), sample, value))
    assert getattr(s, field) is None
    prov = s.provenance[field]
    assert prov.invalid and "INVALID" in prov.describe() and sample.split("{")[0] in prov.describe()
    assert field not in s.present()
    assert any(field in n for n in s.notes)


def test_the_unchanged_fixture_has_no_invalid_field() -> None:
    for name in (SGLANG_FIXTURE, VLLM_FIXTURE):
        s = _one(_fixture(name))
        assert not [k for k, p in s.provenance.items() if p.invalid]


@pytest.mark.parametrize("label, field", [("num_gpu_blocks", "num_blocks"), ("kv_cache_size_tokens", "capacity_tokens"), ("block_size", "block_size")])
def test_vllm_capacity_label_inf_is_invalid(label: str, field: str) -> None:
    body = re.sub(label + r'="\d+"', label + '="inf"', _fixture(VLLM_FIXTURE), count=1)
    s = _one(body)
    assert getattr(s, field) is None and s.provenance[field].invalid


def test_nan_counter_is_absent_not_none_yet() -> None:
    s = _one(_replace(_fixture(SGLANG_FIXTURE), "sglang:num_retracted_requests_total", "NaN"))
    assert s.evictions_total is None  # not the "not created yet" zero


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda t: _replace(t, 'sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.4"', "NaN"), "not a finite count"),
        (lambda t: _replace(t, 'sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.4"', "1"), "decrease"),
        (lambda t: _replace(t, 'sglang:time_to_first_token_seconds_count{engine_type="unified",is_streaming="true"', "1"), "differs from the +Inf bucket"),
        (lambda t: t.replace('is_streaming="true",le="0.4"', 'is_streaming="true",le="0,4"', 1), "not a number"),
    ],
)
def test_impossible_histogram_is_absent_with_the_reason(mutate, reason: str) -> None:  # noqa: ANN001
    s = _one(mutate(_fixture(SGLANG_FIXTURE)))
    assert s.ttft is None and s.provenance["ttft"].invalid and reason in s.provenance["ttft"].note
    assert s.queue_time is not None  # the other histogram is untouched


def test_nan_histogram_sum_keeps_the_buckets() -> None:
    s = _one(_replace(_fixture(VLLM_FIXTURE), "vllm:time_to_first_token_seconds_sum", "NaN"))
    assert s.ttft is not None and math.isnan(s.ttft.sum) and s.ttft.count == 5117


def test_hits_above_queries_are_both_invalid() -> None:
    text = _fixture(VLLM_FIXTURE)
    queries = float(re.search(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    s = _one(_replace(text, "vllm:prefix_cache_hits_total", repr(queries * 1.33)))
    assert s.prefix_hit_tokens_total is None and s.prefix_query_tokens_total is None
    assert s.prefix_hit_ratio is None
    assert "1.33" in s.provenance["prefix_hit_tokens_total"].note


# --- the whole path: the CLI never crashes and prints strict JSON -----------------------------


@pytest.mark.parametrize("fixture, sample, value, field", CASES[:3] + CASES[7:8])
def test_diagnose_and_inspect_json_are_strict_and_do_not_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fixture: str, sample: str, value: str, field: str
) -> None:
    path = tmp_path / "m.prom"
    path.write_text(_replace(_fixture(fixture), sample, value))
    code = cli.main(["diagnose", "--json", str(path)])
    out = strict_loads(capsys.readouterr().out)
    assert code in (0, 1, 2, 3) and out["instances"]  # type: ignore[index]
    assert cli.main(["inspect", "--json", str(path)]) == 0
    [inst] = strict_loads(capsys.readouterr().out)["instances"]  # type: ignore[index]
    assert inst[field] is None if field in inst else True
    assert "INVALID" in inst["provenance"][field]


def test_nan_ttft_bucket_over_a_recording_diagnoses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvdiag.sources.recording import write_recording

    base = _fixture(SGLANG_FIXTURE)
    bad = _replace(base, 'sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.4"', "NaN")
    scrapes = [Scrape(1000.0 + 15 * i, T, None, bad if i % 2 else base) for i in range(8)]
    write_recording(tmp_path / "r.jsonl.gz", scrapes)
    code = cli.main(["diagnose", "--json", "--replay", str(tmp_path / "r.jsonl.gz")])
    [inst] = strict_loads(capsys.readouterr().out)["instances"]  # type: ignore[index]
    assert code in (0, 1, 2, 3) and inst["checks"]["ttft_p99_high"]["status"] in ("ok", "firing", "unknown")


def test_strict_encoder_writes_null_for_non_finite() -> None:
    doc = {"a": math.inf, "b": [math.nan, -math.inf, 1.5], "c": {"d": (2.0, math.nan)}, "e": "NaN"}
    assert strict_loads(dumps(doc)) == {"a": None, "b": [None, None, 1.5], "c": {"d": [2.0, None]}, "e": "NaN"}
    assert dumps({"x": 1}, indent=2) == json.dumps({"x": 1}, indent=2)


# --- counters only grow, except at a real restart ---------------------------------------------


def test_counter_step_rules() -> None:
    assert counter_step(None, 7.0) == 7.0
    assert counter_step(10.0, 12.0) == 2.0
    assert counter_step(120.0, 3.0) == 3.0  # a restart: back near zero
    assert counter_step(120.0, 115.0) is None  # a decrease that is no restart
    assert counter_increase(np.array([120.0, 120.0, 115.0, 120.0])) == 0.0
    assert count_resets(np.array([120.0, 120.0, 115.0, 120.0])) == 0
    assert counter_increase(np.array([120.0, 130.0, 3.0, 10.0])) == 20.0
    assert count_resets(np.array([120.0, 130.0, 3.0, 10.0])) == 1


def _eviction_series(values: list[str]) -> list[PoolSample]:
    text = _fixture(VLLM_FIXTURE)
    return [_one(_replace(text, "vllm:num_preemptions_total", v), ts=1000.0 + 15 * i) for i, v in enumerate(values)]


@pytest.mark.parametrize("glitch", ["-5", "115"])
def test_single_bad_counter_sample_is_no_restart(glitch: str) -> None:
    samples = _eviction_series(["120", "120", glitch, "120"])
    w = Window(samples[0].instance, samples)
    assert w.increase("evictions_total") == 0.0 and w.resets("evictions_total") == 0
    # The exporter's restart-corrected counter never jumps on the glitch.
    inst = InstanceState(samples[0].instance, Ring(16))
    seen = []
    for s in samples:
        inst.ingest(s)
        seen.append(inst.evictions_total)
    assert seen == [120.0, 120.0, 120.0, 120.0]


def test_decrease_without_restart_is_noted_in_the_evidence_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvdiag.sources.recording import write_recording

    text = _fixture(VLLM_FIXTURE)
    values = ["120", "120", "115", "120", "120", "120", "120", "120"]
    scrapes = [Scrape(1000.0 + 15 * i, T, None, _replace(text, "vllm:num_preemptions_total", v)) for i, v in enumerate(values)]
    write_recording(tmp_path / "r.jsonl.gz", scrapes)
    cli.main(["diagnose", "--json", "--replay", str(tmp_path / "r.jsonl.gz")])
    [inst] = strict_loads(capsys.readouterr().out)["instances"]  # type: ignore[index]
    ev = inst["checks"]["evictions_growing"]
    assert ev["status"] == "ok"
    assert "decreased without a restart" in ev["evidence"]["sources"]["evictions_total"]


def test_a_real_restart_still_counts() -> None:
    samples = _eviction_series(["120", "130", "2", "6"])
    w = Window(samples[0].instance, samples)
    assert w.increase("evictions_total") == 16.0 and w.resets("evictions_total") == 1
    inst = InstanceState(samples[0].instance, Ring(16))
    for s in samples:
        inst.ingest(s)
    assert inst.evictions_total == 136.0


def test_histogram_count_decrease_without_restart_is_left_out() -> None:
    from kvdiag.model import Histogram

    def h(c: float) -> Histogram:
        return Histogram((1.0, math.inf), (c, c), c, c)

    samples = [PoolSample("i", "x", float(t), ttft=h(c), provenance={"ttft": Provenance("m")}) for t, c in enumerate([100.0, 110.0, 90.0, 120.0])]
    w = Window("i", samples)
    assert w.histogram_increase("ttft").count == 20.0  # type: ignore[union-attr]
    assert w.invalid_samples("ttft") == 1


# --- the exporter: one target's impossible numbers never take the API down -------------------


def test_exporter_api_serves_every_target_when_one_reports_infinite_pool(raw_server, start_loop) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from kvdiag.server.app import create_app
    from tests.server.conftest import reply, settings_for, wait_for

    bad = _replace(_fixture(SGLANG_FIXTURE), "sglang:max_total_num_tokens", "+Inf")
    bad = _replace(bad, 'sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.4"', "NaN")
    bad_url = raw_server(lambda h: reply(h, 200, bad.encode()))
    good_url = raw_server(lambda h: reply(h, 200, _fixture(VLLM_FIXTURE).encode()))
    loop = start_loop(settings_for([bad_url, good_url]))
    assert wait_for(lambda: all(s.instances and all(i.diagnosis for i in s.instances.values()) for s in loop.snapshot()))
    client = TestClient(create_app(loop), base_url="http://127.0.0.1:10877")
    for path in ("/api/v1/instances", "/api/v1/verdicts", "/"):
        resp = client.get(path)
        assert resp.status_code == 200, path
        if path != "/":
            strict_loads(resp.text)
    rows = client.get("/api/v1/instances").json()["instances"]
    assert len(rows) == 2 and all(r["up"] and r["latest"] is not None for r in rows)  # read, not an error row
    [sglang] = [r for r in rows if r["instance"] == bad_url]
    assert sglang["latest"]["capacity_tokens"] is None and "INVALID" in sglang["latest"]["provenance"]["capacity_tokens"]
    [inst] = [i for i in client.get("/api/v1/verdicts").json()["instances"] if i["engine"] == "sglang"]
    assert inst["checks"]["ttft_p99_high"]["status"] == "unknown"
    fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    capacity = {s.labels["instance"]: s.value for s in fams["kvdiag_kv_capacity_tokens"].samples}
    assert bad_url not in capacity and capacity  # absent for the bad target, present for the good one


def test_hits_outgrowing_queries_over_the_window_are_not_a_ratio() -> None:
    # Every scrape has hits <= queries, but hits rose 400 while queries rose 100: a ratio of 4.
    rows = [(500.0, 1000.0), (700.0, 1050.0), (900.0, 1100.0)]
    prov = {"prefix_hit_tokens_total": Provenance("h"), "prefix_query_tokens_total": Provenance("q")}
    w = Window("i", [PoolSample("i", "x", 15.0 * t, prefix_hit_tokens_total=h, prefix_query_tokens_total=q, provenance=dict(prov)) for t, (h, q) in enumerate(rows)])
    assert not w.has("prefix_hit_tokens_total") and w.increase("prefix_query_tokens_total") == 100.0
    _, last = w.provenance("prefix_hit_tokens_total")
    assert last is not None and last.invalid and "ratio above 1" in last.note
    from kvdiag.checks import prefix
    from kvdiag.config import Config

    assert prefix.evaluate(w, Config()).status == "unknown"
    # hits that rose no more than queries keep their numbers
    ok = Window("i", [PoolSample("i", "x", 15.0 * t, prefix_hit_tokens_total=h, prefix_query_tokens_total=q) for t, (h, q) in enumerate([(500.0, 1000.0), (550.0, 1100.0)])])
    assert ok.increase("prefix_hit_tokens_total") == 50.0
