"""Every verdict and finding, on recordings rendered in both engines' dialects."""

from __future__ import annotations

import pytest

from kvdiag.checks import diagnose, exit_code, undiagnosable
from kvdiag.config import Config
from kvdiag.model import Diagnosis
from kvdiag.refpool.emit import SGLANG_DIALECTS, VLLM_DIALECTS
from tests.checks.scenario import const, ramp, recording, window

ENGINES = ("sglang", "vllm")
CFG = Config()


def run(engine: str, **kw) -> Diagnosis:
    return diagnose(window(recording(engine, **kw)), CFG)


def statuses(d: Diagnosis) -> dict[str, str]:
    return {name: c.status for name, c in d.checks.items()}


def findings(d: Diagnosis) -> set[str]:
    return {f.name for f in d.findings}


BOTTLENECK = dict(usage=const(0.97), waiting=ramp(5, 1), running=const(48), evictions=const(1), ttft=const(20.0))


@pytest.mark.parametrize("engine", ENGINES)
def test_bottleneck_with_numbers_and_knobs(engine: str) -> None:
    d = run(engine, **BOTTLENECK)
    assert (d.verdict.name, d.verdict.severity, d.verdict.exit_code, d.verdict.alert) == (
        "l1_kv_bottleneck", "critical", 2, "KvdiagL1KVPoolBottleneck",
    )  # fmt: skip
    s = statuses(d)
    assert s["kv_usage_saturated"] == s["queue_growing"] == s["evictions_growing"] == "firing"
    assert findings(d) == {"concurrency_not_cache"}  # hit ratio 0.8 and P99 ~20 s
    ev = d.checks["evictions_growing"].evidence
    # PromQL's increase: 59 over 295 s of samples, extrapolated to the 300 s window's edge
    assert ev.values["increase"] == pytest.approx(59 * 300 / 295) and ev.samples == 60 and ev.end - ev.start == 295
    ttft = d.checks["ttft_p99_high"].evidence.values
    assert (ttft["bucket_lower"], ttft["bucket_upper"]) == (10.0, 20.0) and 10 < ttft["estimate_seconds"] <= 20
    # The ceiling: (200,000 pool tokens - 2,400 cached prompt tokens, held once) / (600 uncached + 500 output)
    # per request; every interval evicted with 48 running, so the limit stays below 48.
    assert d.figures["ceiling"] == 179 and d.figures["private_len"] == 1100 and d.figures["running_peak"] == 48
    assert d.figures["limit"] == 47 and d.figures["running_evicted_at"] == 48
    limit = {"sglang": "--max-running-requests 47", "vllm": "--max-num-seqs 47"}[engine]
    fp8 = {"sglang": "--kv-cache-dtype fp8_e4m3", "vllm": "--kv-cache-dtype fp8"}[engine]
    text = "\n".join(d.remedies)
    assert limit in text and fp8 in text and "400,000 pool tokens" in text and "ceiling of 361" in text
    assert "cannot fix P99" in text


@pytest.mark.parametrize(
    ("engine", "dialect"),
    [("sglang", d) for d in SGLANG_DIALECTS if d != "0.5.3"] + [("vllm", d) for d in VLLM_DIALECTS],
)
def test_bottleneck_in_every_dialect_with_a_counter(engine: str, dialect: str) -> None:
    """SGLang 0.4.10 has the cumulative retraction gauge, 0.5.7+ the counter; every vLLM has
    the preemption counter. (0.5.3 has only the last-event gauge: see the unknown tests.)"""
    d = run(engine, dialect=dialect, **BOTTLENECK)
    assert d.verdict.name == "l1_kv_bottleneck", d.verdict.reason


@pytest.mark.parametrize("engine", ENGINES)
def test_bottleneck_escaped_openmetrics_and_tp_ranks(engine: str) -> None:
    d = run(engine, openmetrics=True, escape=True, tp=2 if engine == "sglang" else 1, **BOTTLENECK)
    assert d.verdict.name == "l1_kv_bottleneck"
    assert d.checks["evictions_growing"].evidence.values["increase"] == pytest.approx(59 * 300 / 295)  # TP ranks not double-counted


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("kw", "missing"),
    [
        (dict(usage=const(0.97), waiting=ramp(1, 1), running=const(48)), "evictions_growing"),
        (dict(usage=const(0.97), waiting=const(0), running=const(48), evictions=const(1)), "queue_growing"),
    ],
)
def test_pressure_names_the_missing_signal(engine: str, kw: dict, missing: str) -> None:
    d = run(engine, **kw)
    assert (d.verdict.name, d.verdict.exit_code, d.verdict.alert) == ("l1_kv_pressure", 1, "KvdiagL1KVPoolPressure")
    assert f"not firing: {missing}" in d.verdict.reason


@pytest.mark.parametrize("engine", ENGINES)
def test_short_spike_at_the_end_is_pressure_not_a_pinned_pool(engine: str) -> None:
    usage = lambda i: 0.97 if i >= 57 else 0.6  # noqa: E731
    twice_a_minute = lambda i: 1 if i % 6 == 0 else 0  # noqa: E731 (a storm is evictions_storm a minute)
    d = run(engine, usage=usage, waiting=ramp(1, 1), running=const(48), evictions=twice_a_minute)
    assert d.checks["kv_usage_saturated"].status == "ok"
    assert "spike at the end" in d.checks["kv_usage_saturated"].evidence.summary
    assert d.verdict.name == "l1_kv_pressure"
    assert "not firing: kv_usage_saturated" in d.verdict.reason and "short spike is pressure" in d.verdict.reason


SAW_TOOTH = lambda i: (0.57, 0.75, 0.9, 1.0)[i % 4]  # noqa: E731 (each preemption frees its victim's KV at once)
CLUMPS = lambda i: 0 if i % 3 == 2 else 90  # noqa: E731 (an open loop's arrivals, the newest scrape between two clumps)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_preemption_storm_is_a_pool_that_runs_out_not_a_spike(engine: str) -> None:
    d = run(engine, usage=SAW_TOOTH, waiting=CLUMPS, running=const(20), evictions=const(3))
    s = d.checks["kv_usage_saturated"]
    assert s.status == "firing" and s.evidence.values["eviction_storm"] is True
    assert not s.evidence.values["short_window_pinned"] and not s.evidence.values["long_window_pinned"]
    assert "36 evictions in the last 60s (10 needed) with up to 90 requests waiting" in s.evidence.summary
    assert "runs out again and again" in s.evidence.summary and "spike" not in s.evidence.summary
    assert d.verdict.name in ("l1_kv_bottleneck", "l1_kv_pressure")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_storm_with_nobody_waiting_stays_transient(engine: str) -> None:
    d = run(engine, usage=SAW_TOOTH, waiting=lambda i: 4 if i % 3 == 2 else 0, running=const(20), evictions=const(3))
    assert d.checks["kv_usage_saturated"].status == "ok" and d.checks["evictions_growing"].status == "firing"
    assert d.verdict.name == "healthy" and "transient_evictions" in findings(d)


@pytest.mark.parametrize("engine", ENGINES)
def test_near_capacity(engine: str) -> None:
    d = run(engine, usage=const(0.97), waiting=const(0), running=const(30))
    assert (d.verdict.name, d.verdict.severity, d.verdict.exit_code, d.verdict.alert) == (
        "near_kv_capacity", "info", 0, "KvdiagKVPoolNearCapacity",
    )  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
def test_queue_without_kv_pressure_names_high_usage(engine: str) -> None:
    # (at 0.8, SGLang's running requests reserved their whole output would fill the pool: the reserve branch)
    d = run(engine, usage=const(0.75), waiting=ramp(1, 0.5), running=const(64))
    assert (d.verdict.name, d.verdict.exit_code, d.verdict.alert) == ("queue_without_kv_pressure", 1, "KvdiagQueueWithoutKVPressure")
    assert "without being pinned" in d.verdict.reason
    if engine == "sglang":  # SGLang exports its reservation ratio (new_token_ratio)
        assert "reserve ratio of 0.70" in d.verdict.reason
    assert any("The pool is not the cap" in r for r in d.remedies)


def test_output_reserve_counts_as_taken_where_the_engine_reports_it() -> None:
    """Usage 0.93 with 80 running requests and a backlog: the engine that reserves output
    (reserve ratio 0.70 x 500 tokens per running request, and the next request's whole 500)
    has no room to admit, so its pool is saturated as admission counts it; the engine that
    reserves nothing still has room for the next prompt, and its queue is not KV's doing."""
    kw = dict(usage=const(0.93), waiting=ramp(1, 0.5), running=const(80))
    reserving, plain = run("sglang", **kw), run("vllm", **kw)
    s = reserving.checks["kv_usage_saturated"].evidence.values
    assert reserving.verdict.name == "l1_kv_pressure" and reserving.checks["kv_usage_saturated"].status == "firing"
    assert s["usage_last"] == pytest.approx(0.93) and s["admission_usage_last"] == 1.0
    # 500 x (1 + 0.7 x 80) + 3,000 x (1 - 0.8) tokens
    assert s["need_tokens_last"] == pytest.approx(500 * (1 + 0.7 * 80) + 600) and s["reserve_ratio_last"] == pytest.approx(0.7)
    assert s["admission_basis"] == "usage, uncached prompt and output reserve"
    p = plain.checks["kv_usage_saturated"].evidence.values
    assert plain.verdict.name == "queue_without_kv_pressure"
    # plus the room one step frees (the gauge is read after the frees): 0.93 / (500 - 1)
    assert p["freed_ratio_last"] == pytest.approx(0.93 / 499) and s["freed_ratio_last"] == 0.0
    assert p["admission_usage_last"] == pytest.approx(0.93 + 600 / 200_000 + 0.93 / 499)
    assert p["admission_basis"] == "usage and uncached prompt and the room one step frees"


def test_room_a_step_frees_counts_as_taken_where_the_gauge_is_read_after_the_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    """5-token answers: a request lives five steps, so one step frees a quarter of what the
    running requests hold after it, and the next admission refills it at once. Usage 0.8 and a
    backlog is a saturated pool on the engine that reads the gauge after the frees (vLLM); an
    engine that lives one step per request is bounded by its token budget: nothing is added."""
    monkeypatch.setattr("tests.checks.scenario.OUTPUT", 5)
    kw = dict(usage=const(0.8), waiting=ramp(1, 0.5), running=const(80))
    d = run("vllm", **kw)
    s = d.checks["kv_usage_saturated"].evidence.values
    assert s["freed_ratio_last"] == pytest.approx(0.8 / 4) and s["admission_usage_last"] == 1.0
    assert d.verdict.name == "l1_kv_pressure"
    monkeypatch.setattr("tests.checks.scenario.OUTPUT", 1)
    one = run("vllm", **kw).checks["kv_usage_saturated"].evidence.values
    assert one["freed_ratio_last"] == 0.0 and one["admission_usage_last"] == pytest.approx(0.8 + 600 / 200_000)


def test_output_reserve_is_clipped_as_the_engine_clips_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """10k-token answers: admission charges each request at most the engine's clip (4,096)."""
    monkeypatch.setattr("tests.checks.scenario.OUTPUT", 10_000)
    s = run("sglang", usage=const(0.5), running=const(20)).checks["kv_usage_saturated"].evidence.values
    assert s["output_per_request"] == 10_000
    assert s["need_tokens_last"] == pytest.approx(4096 * (1 + 0.7 * 20) + 600)


@pytest.mark.parametrize("engine", ENGINES)
def test_admission_usage_is_the_usage_gauge_without_traffic_counters(engine: str) -> None:
    d = run(engine, usage=const(0.96), requests=0)
    s = d.checks["kv_usage_saturated"].evidence.values
    assert s["admission_usage_last"] == s["usage_last"] and s["admission_basis"] == "usage only: no tokens per request, prefix hit ratio"
    assert d.verdict.name == "near_kv_capacity"


@pytest.mark.parametrize("engine", ENGINES)
def test_queue_without_kv_pressure_low_usage_has_no_usage_note(engine: str) -> None:
    d = run(engine, usage=const(0.3), waiting=ramp(1, 0.5), running=const(64))
    assert d.verdict.name == "queue_without_kv_pressure" and "without being pinned" not in d.verdict.reason


@pytest.mark.parametrize("engine", ENGINES)
def test_backlog_not_draining_is_a_growing_queue(engine: str) -> None:
    """A flat queue as long as the running batch: admission is not keeping up."""
    d = run(engine, usage=const(0.3), waiting=const(40), running=const(32))
    q = d.checks["queue_growing"]
    assert q.status == "firing" and q.evidence.values["backlog_not_draining"] is True
    assert q.evidence.values["slope_per_min"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_draining_queue_does_not_fire(engine: str) -> None:
    d = run(engine, usage=const(0.3), waiting=lambda i: max(0, 80 - 2 * i), running=const(32))
    assert d.checks["queue_growing"].status == "ok" and d.verdict.name == "healthy"
    # a queue that drains but never once empties for a minute (80 -> 21) stands: still a backlog
    stands = run(engine, usage=const(0.3), waiting=ramp(80, -1), running=const(32))
    assert stands.checks["queue_growing"].evidence.values["backlog_standing"] is True
    assert stands.verdict.name == "queue_without_kv_pressure"


@pytest.mark.parametrize("engine", ENGINES)
def test_healthy(engine: str) -> None:
    d = run(engine)
    assert (d.verdict.name, d.verdict.exit_code, d.verdict.alert, d.findings) == ("healthy", 0, None, [])
    assert d.remedies == []


@pytest.mark.parametrize("engine", ENGINES)
def test_transient_evictions_finding(engine: str) -> None:
    d = run(engine, evictions=lambda i: 1 if i % 20 == 15 else 0)  # the last 20 s before the end
    assert d.verdict.name == "healthy" and findings(d) == {"transient_evictions"}
    assert any("if they recur" in r for r in d.remedies)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_old_eviction_does_not_hold_l1_pressure(engine: str) -> None:
    """Issue 15: one retraction two minutes ago and a compute-bound queue since: the pool ran
    out then, it does not limit now (queue_without_kv_pressure), and the window still counts
    the eviction in E's evidence. The same eviction in the last minute, or with usage + the next
    admission's need held at ~0.9 since (not pinned, as full as when it ran out): l1_kv_pressure."""
    load = dict(usage=const(0.5), waiting=ramp(5, 1), running=const(48))
    old = run(engine, evictions=lambda i: 1 if i == 35 else 0, **load)  # 120 s before the last scrape
    e = old.checks["evictions_growing"]
    assert (old.verdict.name, e.status) == ("queue_without_kv_pressure", "ok")
    assert e.evidence.values["increase"] >= 1 and e.evidence.values["increase_recent"] == 0
    new = run(engine, evictions=lambda i: 1 if i == 55 else 0, **load)  # 20 s before it
    assert new.verdict.name == "l1_kv_pressure" and new.checks["evictions_growing"].evidence.values["increase_recent"] >= 1
    usage = {"sglang": 0.81, "vllm": 0.9}[engine]  # SGLang's need adds its output reserve, ~0.09 here
    held = run(engine, evictions=lambda i: 1 if i == 35 else 0, **{**load, "usage": const(usage)})
    e = held.checks["evictions_growing"]
    assert (held.verdict.name, held.checks["kv_usage_saturated"].status, e.status) == ("l1_kv_pressure", "ok", "firing")
    assert e.evidence.values["increase_recent"] == 0 and 0.85 <= e.evidence.values["held_admission_usage"] < 0.95
    assert "stayed full since" in e.evidence.summary


@pytest.mark.parametrize("engine", ENGINES)
def test_p99_high_without_kv_pressure(engine: str) -> None:
    d = run(engine, ttft=const(15.0), hit=0.1)
    assert d.verdict.name == "healthy" and findings(d) == {"p99_high_without_kv_pressure"}
    assert any("prefill compute" in r for r in d.remedies)


def test_l2_irrelevant_to_p99_where_l2_has_room() -> None:
    """SGLang with HiCache: L1 pinned, L2 at 5 % occupancy."""
    d = run("sglang", l2_capacity=400_000, l2_used=const(20_000), l2_hit=0.01, **BOTTLENECK)
    l2 = d.checks["l2_underused"]
    assert l2.status == "firing" and l2.evidence.values["l2_occupancy"] == pytest.approx(0.05)
    assert findings(d) == {"concurrency_not_cache", "l2_irrelevant_to_p99"}


def test_l2_in_use_is_not_underused() -> None:
    d = run("sglang", l2_capacity=400_000, l2_used=const(360_000), l2_hit=0.3, **BOTTLENECK)
    assert d.checks["l2_underused"].status == "ok" and "l2_irrelevant_to_p99" not in findings(d)


def test_vllm_l2_from_host_hits() -> None:
    """vLLM exports no L2 occupancy; host-tier hits (cached_by_source) say an L2 exists."""
    d = run("vllm", l2_hit=0.02, **BOTTLENECK)
    l2 = d.checks["l2_underused"]
    assert l2.status == "firing" and l2.evidence.values["l2_hit_share"] == pytest.approx(0.02, abs=1e-3)


@pytest.mark.parametrize("engine", ENGINES)
def test_no_l2_is_unknown_not_ok(engine: str) -> None:
    l2 = run(engine, **BOTTLENECK).checks["l2_underused"]
    assert l2.status == "unknown" and "no L2 tier reported" in l2.evidence.summary


@pytest.mark.parametrize("engine", ENGINES)
def test_restart_mid_window_yields_no_false_evictions(engine: str) -> None:
    d = run(engine, restart_at=30, usage=const(0.5))
    e = d.checks["evictions_growing"]
    assert e.status == "ok" and e.evidence.values["increase"] == 0
    ttft = d.checks["ttft_p99_high"]
    assert ttft.status == "ok" and ttft.evidence.values["observations"] == 20 * 59  # reset-safe histogram


@pytest.mark.parametrize("engine", ENGINES)
def test_restart_mid_window_counts_evictions_on_both_sides(engine: str) -> None:
    d = run(engine, restart_at=30, evictions=const(2))
    e = d.checks["evictions_growing"].evidence
    assert e.values["increase"] == pytest.approx(2 * 59 * 300 / 295)  # every interval's 2, none lost or doubled at the reset
    if engine == "vllm":
        assert e.values["resets"] == 1 and "reset" in e.summary


def test_old_sglang_last_event_gauge_only_settles_on_the_pool() -> None:
    """SGLang 0.5.3 exports retractions only as the last-event gauge: growth is never rated. With
    the pool pinned, either answer names the pool: the least of them, naming the other, and how
    to get the missing counter."""
    d = run("sglang", dialect="0.5.3", usage=const(0.97), waiting=const(0), evictions=const(3))
    e = d.checks["evictions_growing"]
    assert e.status == "unknown" and e.missing == ("evictions_total",)
    assert "last-event" in e.evidence.summary and "0.5.7" in e.hint
    assert d.verdict.name == "near_kv_capacity" and d.verdict.exit_code == 0
    assert "evictions_growing unknown" in d.verdict.reason and "l1_kv_pressure if it fires" in d.verdict.reason
    assert any("0.5.7" in r for r in d.remedies)


def test_unknown_signal_that_cannot_change_the_answer_still_decides() -> None:
    """Idle old SGLang: S and Q do not fire, so E cannot change 'healthy'."""
    d = run("sglang", dialect="0.5.3")
    assert d.verdict.name == "healthy" and "same either way" in d.verdict.reason


def test_sglang_counter_not_yet_created_is_zero_not_unknown() -> None:
    d = run("sglang")  # 0.5.23 renders no retraction counter until the first retraction
    e = d.checks["evictions_growing"]
    assert e.status == "ok" and "not created until the first retraction" in e.evidence.values["source"]


@pytest.mark.parametrize("engine", ENGINES)
def test_single_exposition_gives_point_in_time_answers(engine: str) -> None:
    d = diagnose(window(recording(engine, steps=1, **BOTTLENECK)), CFG)
    s = statuses(d)
    assert s["kv_usage_saturated"] == "firing" and s["prefix_hit_high"] == "firing" and s["ttft_p99_high"] == "firing"
    for growth in ("queue_growing", "evictions_growing"):
        c = d.checks[growth]
        assert c.status == "unknown" and "needs a window" in c.evidence.summary and c.missing == ("window",)
    assert d.checks["ttft_p99_high"].evidence.values["basis"] == "lifetime"
    # a pinned pool names the pool whatever the growth checks would say: the least such answer
    assert d.verdict.name == "near_kv_capacity" and d.samples == 1 and "l1_kv_bottleneck" in d.verdict.reason
    assert any("recording" in r for r in d.remedies)


def test_ttft_above_the_last_finite_bucket_fires() -> None:
    """vLLM V0 0.6/0.7 buckets stop at 10 s: a P99 of 30 s reads as 'above 10 s', which is
    above an SLO of 10 s although the estimate itself is the bound."""
    d = run("vllm", dialect="0.6", ttft=const(30.0))
    t = d.checks["ttft_p99_high"]
    assert t.status == "firing" and t.evidence.values["bucket_upper"] is None and t.evidence.values["estimate_seconds"] == 10.0


@pytest.mark.parametrize("engine", ENGINES)
def test_idle_engine_is_below_the_traffic_floor(engine: str) -> None:
    d = run(engine, requests=0, usage=const(0.0), running=const(0))
    t = d.checks["ttft_p99_high"]
    assert t.status == "ok" and t.evidence.values["observations"] == 0 and "traffic floor" in t.evidence.summary
    p = d.checks["prefix_hit_high"]
    assert p.status == "ok" and p.evidence.values["hit_ratio"] is None
    assert d.verdict.name == "healthy"


def test_vllm_v0_hit_rate_gauge_fallback() -> None:
    d = run("vllm", dialect="0.6", hit=0.7)
    p = d.checks["prefix_hit_high"]
    assert p.status == "firing" and p.evidence.values["basis"] == "gauge"


def test_exit_code_is_the_worst_over_instances() -> None:
    healthy = run("vllm")
    pressure = run("vllm", usage=const(0.97), waiting=ramp(1, 1))
    bottleneck = run("sglang", **BOTTLENECK)
    unknown = undiagnosable("http://x", "not an engine", 0.0)
    assert exit_code([healthy]) == 0
    assert exit_code([healthy, pressure]) == 1
    assert exit_code([healthy, pressure, unknown]) == 3
    assert exit_code([unknown, bottleneck, pressure]) == 2
    assert exit_code([]) == 3


@pytest.mark.parametrize(("engine", "hint"), [("sglang", "--enable-metrics"), ("vllm", "--disable-log-stats")])
def test_absent_usage_is_unknown_with_the_reason_and_the_enable_hint(engine: str, hint: str) -> None:
    """Samples built directly: an instance that reports its queue but no pool usage."""
    from kvdiag.model import PoolSample, Provenance
    from kvdiag.window import Window

    samples = []
    for i in range(12):
        s = PoolSample("http://h:1", engine, 1000.0 + 5 * i)
        s.set("waiting", 0.0, Provenance("waiting"))
        s.set("running", 4.0, Provenance("running"))
        s.set("evictions_total", 0.0, Provenance("evictions"))
        samples.append(s)
    d = diagnose(Window("http://h:1", samples), CFG)
    sat = d.checks["kv_usage_saturated"]
    assert sat.status == "unknown" and sat.missing == ("usage_ratio",) and hint in sat.hint
    assert "usage_ratio not reported" in sat.evidence.summary
    assert d.verdict.name == "unknown" and "kv_usage_saturated unknown" in d.verdict.reason
    assert any(hint in r for r in d.remedies)
    assert d.checks["ttft_p99_high"].status == "unknown" and d.checks["ttft_p99_high"].missing == ("ttft",)


def test_a_check_that_fails_on_one_instance_leaves_the_others_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """diagnose_all contains a failure per instance, as the exporter contains one per target."""
    import kvdiag.checks as checks
    from kvdiag.checks import diagnose_all

    good, bad = window(recording("vllm", **BOTTLENECK)), window(recording("sglang", **BOTTLENECK))
    real = checks.EVALUATORS["queue_growing"]

    def broken(w, config):  # type: ignore[no-untyped-def]
        if w.engine == "sglang":
            raise ZeroDivisionError("float division by zero")
        return real(w, config)

    monkeypatch.setitem(checks.EVALUATORS, "queue_growing", broken)
    first, second = diagnose_all([bad, good], CFG)
    assert first.verdict.name == "unknown" and "internal error in the checks: ZeroDivisionError" in first.verdict.reason
    assert second.verdict.name == "l1_kv_bottleneck"
    assert exit_code([first]) == 3 and exit_code([first, second]) == 2  # a critical answer outranks an unknown one


# --- shapes real engines produce (issue 28) ------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_closed_loop_standing_backlog_is_a_queue(engine: str) -> None:
    """24 clients in a closed loop, 2-3 running: the queue stands at 21-22, wandering down as
    often as up (its one-minute slope is negative here), and never grows. It is a queue."""
    d = run(engine, usage=const(0.6), waiting=lambda i: 22 - (i // 2) % 2 - max(0, i - 50) // 3, running=lambda i: 3 - (i % 5 == 0))
    q = d.checks["queue_growing"]
    assert q.status == "firing", q.evidence.summary
    assert q.evidence.values["backlog_standing"] is True and q.evidence.values["growing"] is False
    assert "it stands" in q.evidence.summary


@pytest.mark.parametrize("engine", ENGINES)
def test_slow_steady_queue_keeps_firing(engine: str) -> None:
    """Waiting 24 -> 60 over five minutes beside 128 running (+7.4/min): the last minute rises
    less than 5 % of the batch, but the queue grows; with the pool at 0.99 and no eviction
    counter read, the verdict names the pool (pressure), never unknown nor near capacity."""
    d = run(engine, usage=const(0.99), waiting=lambda i: 24 + 30 * i / 47 if i <= 47 else 54 + (i - 47) / 2, running=const(128))
    q = d.checks["queue_growing"]
    assert q.evidence.values["rise_short"] < q.evidence.values["rise_needed"]
    assert q.status == "firing" and q.evidence.values["growing_slowly"] is True, q.evidence.summary
    assert d.verdict.name in ("l1_kv_pressure", "l1_kv_bottleneck"), d.verdict.reason


@pytest.mark.parametrize("engine", ENGINES)
def test_preemption_storm_with_a_paused_queue_names_the_pool(engine: str) -> None:
    """vLLM under an open-loop overload: the usage gauge saw-tooths (each preemption frees its
    victim at once), 94 waiting with the queue paused (-1 over the last minute), two or three
    preemptions every scrape. The pool ran out: never healthy, never "a spike"."""
    d = run(engine, usage=lambda i: (0.57, 0.8, 0.96, 0.97)[i % 4] if i < 58 else 0.96,
            waiting=lambda i: min(94, 40 + i) if i < 48 else 94 - (i % 2), running=const(16),
            evictions=lambda i: 2 + i % 2)
    assert d.verdict.name in ("l1_kv_pressure", "l1_kv_bottleneck"), d.verdict.reason
    s = d.checks["kv_usage_saturated"].evidence.summary
    assert "spike" not in s and "saw-tooths" in s


def test_the_evidence_never_rounds_a_miss_onto_the_threshold() -> None:
    from kvdiag.checks.saturation import against

    assert against(0.949, 0.95) == "0.949" and against(0.9499999, 0.95) == "0.949"
    assert against(0.95, 0.95) == "0.95" and against(0.97, 0.95) == "0.97" and against(0.42, 0.95) == "0.42"


RESERVE_BLOCKED = dict(capacity=8000, usage=const(0.7), waiting=lambda i: 21 + i % 2, running=lambda i: 3 - (i % 3 == 1),
                       new_token_ratio=const(0.098))


def test_reserve_blocked_admission_is_l1_where_the_gauge_never_pins() -> None:
    """SGLang at its defaults: 2-3 running, 21-22 waiting, the usage gauge at 0.7 and the
    exported ratio decayed to 0.098 (usage + need 0.86). Reserving every running request's whole remaining output
    (what a request that ignores EOS, or asks for more than it gets, is reserved) fills the
    pool: the reserve refuses admission, the pool is the answer, not prefill compute."""
    d = run("sglang", **RESERVE_BLOCKED)
    s = d.checks["kv_usage_saturated"]
    assert s.status == "firing" and s.evidence.values["reserve_blocked"] is True, s.evidence.summary
    assert s.evidence.values["short_window_pinned"] is False and s.evidence.values["long_window_pinned"] is False
    assert "the reserve can be what refuses admission" in s.evidence.summary
    assert d.verdict.name == "l1_kv_pressure", d.verdict.reason
    assert "p99_high_without_kv_pressure" not in findings(d)
    (text,) = [r for r in d.remedies if "output reserve" in r]
    # 3 running x 500 output x (1 - 0.098) = 1,353 tokens beyond the need, 17 % of 8,000
    assert "reserve ratio of 0.098" in text and "1,353 more tokens (17% of the pool)" in text and "0.70" in text
    assert "--schedule-conservativeness" in text and "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION=N" in text
    assert "500 output tokens each" in text and "retracting" in text


def test_a_scrape_taken_at_a_prefill_does_not_hide_the_reserve() -> None:
    """A real SGLang held by its reserve (2-3 running, 20-22 waiting) read 1 running at the
    scrapes its gauges were published at a prefill: the request being admitted counted neither
    waiting nor running. The reserve is charged for the most running over the short window, so
    that scrape stays L1 (with the newest reading alone the bound fell to 0.75-0.90 and the
    verdict to queue_without_kv_pressure), and the remedy counts the 3."""
    d = run("sglang", **dict(RESERVE_BLOCKED, running=lambda i: 1 if i == 59 else 3))
    s = d.checks["kv_usage_saturated"].evidence.values
    assert s["reserve_blocked"] is True and s["reserve_running"] == 3, d.checks["kv_usage_saturated"].evidence.summary
    assert d.verdict.name == "l1_kv_pressure", d.verdict.reason
    (text,) = [r for r in d.remedies if "output reserve" in r]
    assert "while 3 running requests" in text, text


def test_a_queue_that_has_just_reached_the_floor_behind_the_reserve_is_named_at_once() -> None:
    """A real SGLang's open-loop overload: the reserve refuses admission and the queue grows
    from the first refusal (0 for 50 s, then +1 a scrape). The reserve branch fires at the
    first sample with queue_min_growth waiting (the queue check's rise fires there too), not
    after the queue has stood at the floor for the whole short window (20 s later)."""
    grow = dict(RESERVE_BLOCKED, waiting=lambda i: max(0, i - 54), steps=60)  # 5 waiting at the last sample
    d = run("sglang", **grow)
    s = d.checks["kv_usage_saturated"]
    assert s.evidence.values["queue_waiting"] is True and s.evidence.values["reserve_blocked"] is True, s.evidence.summary
    assert d.verdict.name == "l1_kv_pressure", d.verdict.reason
    before = run("sglang", **dict(grow, steps=59))  # 4 waiting: below the floor, not yet admission refusing
    assert before.checks["kv_usage_saturated"].evidence.values["reserve_blocked"] is False
    assert before.verdict.name != "l1_kv_pressure"


def test_reserve_branch_needs_a_standing_queue_and_a_reserving_engine() -> None:
    quiet = run("sglang", **{**RESERVE_BLOCKED, "waiting": const(0)})
    assert quiet.checks["kv_usage_saturated"].status == "ok" and quiet.verdict.name == "healthy"
    assert quiet.checks["kv_usage_saturated"].evidence.values["reserve_blocked"] is False
    assert not any("output reserve" in r for r in quiet.remedies)
    pinned = run("sglang", **{**RESERVE_BLOCKED, "usage": const(0.97)})  # a pinned pool: the reserve is not the story
    assert pinned.verdict.name == "l1_kv_pressure" and not any("output reserve" in r for r in pinned.remedies)
    vllm = run("vllm", **RESERVE_BLOCKED)  # vLLM reserves no output: its queue beside room is not the pool
    assert vllm.checks["kv_usage_saturated"].evidence.values["reserve_gap_last"] is None
    assert vllm.verdict.name == "queue_without_kv_pressure"
