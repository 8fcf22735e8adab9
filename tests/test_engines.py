"""Engine adapters: every dialect to the same normalized numbers, with provenance."""

from __future__ import annotations

import pytest

from kvdiag.engines import UnknownEngine, normalize_scrape
from kvdiag.model import HISTOGRAM_FIELDS, NUMERIC_FIELDS, PoolSample, Scrape
from kvdiag.refpool.emit import SGLANG_DIALECTS, VLLM_DIALECTS, EngineState, render
from tests.dialects import ESCAPINGS, reexpose

T = "http://10.0.0.1:8000"


def _samples(body: str, content_type: str | None = None) -> list[PoolSample]:
    return normalize_scrape(Scrape(100.0, T, content_type, body))


def test_sglang_fixture_numbers(sglang_fixture: str) -> None:
    [s] = _samples(sglang_fixture)
    assert (s.engine, s.instance, s.model) == ("sglang", T, "meta-llama/Llama-3.1-8B-Instruct")
    assert s.capacity_tokens == 196608 and s.usage_ratio == 0.97 and s.usage_granularity == "token"
    assert (s.used_tokens, s.evictable_tokens, s.available_tokens) == (190709, 3890, 2009)
    assert s.used_tokens + s.evictable_tokens + s.available_tokens == s.capacity_tokens
    assert (s.running, s.waiting, s.evictions_total, s.last_eviction_event) == (48, 35, 120, 2)
    assert s.prefix_hit_tokens_total / s.prefix_query_tokens_total == pytest.approx(0.8, abs=1e-3)
    assert s.ttft.count == 5117 and s.ttft.counts[-1] == 5117  # streaming + non-streaming added
    assert s.ttft.bounds[0] == 0.1 and s.queue_time.count == 5165
    assert s.decode_reserve_ratio == 0.7
    assert s.l2_capacity_tokens is None  # no HiCache in this deployment: absent, not 0
    assert s.provenance["evictions_total"].metric == "sglang:num_retracted_requests_total"
    assert s.provenance["usage_ratio"].metric == "sglang:token_usage"


def test_vllm_fixture_numbers(vllm_fixture: str) -> None:
    [s] = _samples(vllm_fixture)
    assert (s.engine, s.instance) == ("vllm", T + " engine=0")
    assert s.capacity_tokens == 196592 and s.block_size == 16 and s.num_blocks == 12288
    assert s.capacity_tokens == (s.num_blocks - 1) * s.block_size  # the null block
    assert s.usage_ratio == 0.97 and s.usage_granularity == "block"
    assert s.evictable_tokens is None and s.available_tokens is None  # vLLM never splits them
    assert s.provenance["used_tokens"].derived
    assert (s.running, s.waiting, s.evictions_total) == (48, 35, 120)
    assert s.prefix_hit_tokens_total / s.prefix_query_tokens_total == pytest.approx(0.8, abs=1e-3)
    assert s.ttft.count == 5117 and s.ttft.bounds[-2] == 2560.0
    assert s.provenance["evictions_total"].metric == "vllm:num_preemptions_total"


def test_length_histograms_from_real_expositions(sglang_fixture: str, vllm_fixture: str) -> None:
    """Both engines' per-request length histograms as their /metrics show them (SGLang 0.5.23's
    100...1.1e6 buckets, vLLM 0.33.0's 1-2-5 series up to max_model_len), in the histogram type
    TTFT uses, with the metric they came from."""
    [s] = _samples(sglang_fixture)
    p, o = s.prompt_lengths, s.output_lengths
    assert (p.count, p.sum, o.count, o.sum) == (5117, 1.7813234e7, 5117, 2.599673e6)
    assert p.bounds[:3] == (100.0, 300.0, 500.0) and p.bounds[-2] == 1.1e6 and o.bounds == p.bounds
    assert dict(zip(p.bounds, p.counts))[3000.0] == 1721 and dict(zip(o.bounds, o.counts))[300.0] == 1196
    assert (s.provenance["prompt_lengths"].metric, s.provenance["output_lengths"].metric) == (
        "sglang:prompt_tokens_histogram", "sglang:generation_tokens_histogram")
    [v] = _samples(vllm_fixture)
    p, o = v.prompt_lengths, v.output_lengths
    assert p.bounds[:4] == (1.0, 2.0, 5.0, 10.0) and p.bounds[-2] == 20000.0  # this server's max_model_len
    assert (p.count, p.sum, o.sum) == (5117, 1.7792191e7, 2.604324e6)
    assert dict(zip(p.bounds, p.counts))[2000.0] == 2 and dict(zip(o.bounds, o.counts))[500.0] == 2535
    assert v.provenance["prompt_lengths"].metric == "vllm:request_prompt_tokens"


def test_length_histograms_stay_absent_where_none_is_exported() -> None:
    """The releases the facts read export them (SGLang from its first finished request); the
    other dialects and an SGLang server that has finished nothing leave them absent, not empty."""
    st = _state()
    for prompt, output, cached in ((120, 30, 0), (900, 250, 600), (2500, 4, 100)):
        st.observe_finished(prompt, output, cached)
    for engine, dialects in (("sglang", SGLANG_DIALECTS), ("vllm", VLLM_DIALECTS)):
        for dialect in dialects:
            [s] = _samples(render(engine, [st], dialect))
            if dialect in ("0.5.23", "0.33.0"):
                assert (s.prompt_lengths.count, s.prompt_lengths.sum, s.output_lengths.sum) == (3, 3520, 284), dialect
            else:
                assert s.prompt_lengths is None and s.output_lengths is None and "prompt_lengths" not in s.provenance, dialect
    [idle] = _samples(render("sglang", [_state()], "0.5.23"))
    assert idle.prompt_lengths is None and idle.output_lengths is None
    [fresh] = _samples(render("vllm", [_state()], "0.33.0"))  # registered at start: an empty histogram
    assert fresh.prompt_lengths is not None and fresh.prompt_lengths.count == 0


def _state(**kw: float) -> EngineState:
    base = dict(
        capacity_tokens=100_000, used_tokens=96_000, evictable_tokens=2_500, running=40, waiting=12,
        evictions_total=30, last_eviction_event=3, prefix_hit_tokens_total=70_000, prompt_tokens_total=100_000, prefill_input_tokens_total=30_000,
        generation_tokens_total=20_000, requests_total=300,
    )  # fmt: skip
    base.update(kw)
    st = EngineState(**base)  # type: ignore[arg-type]
    for v in (0.05, 0.3, 2.0, 30.0):
        st.ttft.observe(v)
        st.queue_time.observe(v)
    return st


@pytest.mark.parametrize("dialect", SGLANG_DIALECTS)
@pytest.mark.parametrize("wire", ["text", "openmetrics", "openmetrics-escaped"])
def test_sglang_dialects(dialect: str, wire: str) -> None:
    st = _state()
    body = render("sglang", [st], dialect, openmetrics=wire != "text", escape=wire.endswith("escaped"))
    if wire.endswith("escaped"):
        assert "\nsglang_num_running_reqs{" in body  # the escaped spelling really is on the wire
    [s] = _samples(body)
    assert s.usage_ratio == 0.96 and s.running == 40 and s.waiting == 12
    assert s.used_tokens == 96_000
    assert s.prefix_hit_tokens_total / s.prefix_query_tokens_total == pytest.approx(0.7)
    assert s.ttft.count == 4
    if dialect == "0.5.23":  # the three states apart since 0.5.11
        assert (s.evictable_tokens, s.available_tokens) == (2_500, 1_500)
    else:
        assert s.evictable_tokens is None and s.available_tokens is None
    if dialect in ("0.5.23", "0.5.9"):
        assert s.capacity_tokens == 100_000 and not s.provenance["capacity_tokens"].derived
        assert s.evictions_total == 30
    else:  # no capacity gauge before 0.5.6: derived from the rounded usage
        assert s.provenance["capacity_tokens"].derived
        assert s.capacity_tokens == pytest.approx(100_000, rel=0.01)
    if dialect == "0.5.3":  # only the last-event gauge: never rated, so unknown
        assert s.evictions_total is None and s.last_eviction_event == 3
        assert any("cannot be rated" in n for n in s.notes)
    if dialect == "0.4.10":
        assert s.evictions_total == 30 and "cumulative gauge" in s.provenance["evictions_total"].note


@pytest.mark.parametrize("dialect", VLLM_DIALECTS)
@pytest.mark.parametrize("wire", ["text", "openmetrics", "openmetrics-escaped"])
def test_vllm_dialects(dialect: str, wire: str) -> None:
    st = _state(capacity_tokens=16 * 6_000, used_tokens=16 * 5_700)
    body = render("vllm", [st], dialect, openmetrics=wire != "text", escape=wire.endswith("escaped"))
    [s] = _samples(body)
    assert s.usage_ratio == pytest.approx(0.95) and s.usage_granularity == "block"
    assert (s.running, s.waiting, s.evictions_total) == (40, 12, 30)
    assert s.capacity_tokens == 96_000
    assert s.ttft.count == 4
    if dialect == "0.6":  # V0: one instance, no engine label, a hit-rate gauge only
        assert s.instance == T and s.prefix_hit_tokens_total is None
        assert s.prefix_hit_ratio_gauge == pytest.approx(0.7)
        assert s.provenance["usage_ratio"].metric == "vllm:gpu_cache_usage_perc"
        assert s.ttft.bounds[-2] == 10.0
    else:
        assert s.instance == T + " engine=0"
        assert s.prefix_hit_tokens_total / s.prefix_query_tokens_total == pytest.approx(0.7)
    if dialect in ("0.33.0", "0.10"):
        assert s.provenance["usage_ratio"].metric == "vllm:kv_cache_usage_perc"
    if dialect == "0.8":
        assert s.provenance["usage_ratio"].metric == "vllm:gpu_cache_usage_perc"
        assert s.provenance["prefix_query_tokens_total"].metric == "vllm:gpu_prefix_cache_queries_total"


def test_vllm_dp_engines_are_instances_and_capacity_is_split() -> None:
    a, b = _state(capacity_tokens=16_000, used_tokens=16_000), _state(capacity_tokens=16_000, used_tokens=1_600)
    for dialect in ("0.33.0", "0.10"):  # per-engine kv_cache_size_tokens, then num_gpu_blocks summed
        samples = _samples(render("vllm", [a, b], dialect))
        assert [s.instance for s in samples] == [T + " engine=0", T + " engine=1"]
        assert [s.usage_ratio for s in samples] == [1.0, 0.1]
        assert all(s.capacity_tokens == 16_000 for s in samples)


def test_vllm_multiprocess_pid_labels_collapse() -> None:
    body = render("vllm", [_state()], "0.10", multiprocess=True)
    assert 'pid="' in body and "_created" not in body
    [s] = _samples(body)
    assert s.usage_ratio is not None and s.running == 40


def test_sglang_tp_ranks_are_not_double_counted_and_dp_ranks_split() -> None:
    [s] = _samples(render("sglang", [_state()], tp=4))
    assert (s.running, s.waiting, s.used_tokens, s.evictions_total) == (40, 12, 96_000, 30)
    a, b = _state(running=10), _state(running=20)
    samples = _samples(render("sglang", [a, b], tp=2))
    assert [(s.instance, s.running) for s in samples] == [(T + " dp_rank=0", 10), (T + " dp_rank=1", 20)]
    # Tokenizer series (TTFT) are per server: flagged as such on every DP instance.
    assert "server-wide" in samples[0].provenance["ttft"].note


def test_sglang_counter_not_yet_created_is_zero_not_absent() -> None:
    [s] = _samples(render("sglang", [_state(evictions_total=0)]))
    assert "num_retracted_requests_total" not in render("sglang", [_state(evictions_total=0)])
    assert s.evictions_total == 0 and s.provenance["evictions_total"].derived


def test_absent_is_not_zero_and_zero_is_not_absent() -> None:
    body = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 0.0\n"
    [s] = _samples(body)
    assert s.running == 0.0 and s.waiting is None and s.usage_ratio is None and s.evictions_total is None


def test_nan_gauge_is_absent_with_a_note() -> None:
    body = 'sglang:num_running_reqs{tp_rank="0"} 3\nsglang:token_usage{tp_rank="0"} NaN\n'
    [s] = _samples(body)
    assert s.usage_ratio is None and any("NaN" in n for n in s.notes)


def test_unknown_engines_say_why() -> None:
    disabled = "# TYPE http_requests_total counter\nhttp_requests_total{handler=\"/v1\"} 3\npython_info{version=\"3.12\"} 1\n"
    with pytest.raises(UnknownEngine, match="disable-log-stats") as err:
        _samples(disabled)
    assert "http" in str(err.value) and "python" in str(err.value)
    with pytest.raises(UnknownEngine, match="no samples"):
        _samples("")
    both = "sglang:num_running_reqs 1\nvllm:num_requests_running 1\n"
    with pytest.raises(UnknownEngine, match="both"):
        _samples(both)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_instance_cap_is_checked_before_any_instance_is_normalized(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body claiming too many instances costs one read, not a normalization per instance."""
    from kvdiag.engines import ADAPTERS, TooManyInstances

    body = render(engine, [EngineState(capacity_tokens=1000, running=1, waiting=i % 3) for i in range(9)], openmetrics=False)
    got = normalize_scrape(Scrape(0.0, T, None, body), max_instances=9)
    assert [s.waiting for s in got] == [i % 3 for i in range(9)]  # at the cap: all kept, each its own

    def refuse(*_: object) -> None:
        raise AssertionError("normalize ran on a body over the cap")

    monkeypatch.setattr(ADAPTERS[engine], "normalize", refuse)
    with pytest.raises(TooManyInstances, match="9 instances in one exposition"):
        normalize_scrape(Scrape(0.0, T, None, body), max_instances=8)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_server_wide_series_reach_every_data_parallel_instance(engine: str) -> None:
    """Grouping samples by split label: split rows go to their instance, unsplit rows to all."""
    states = [EngineState(capacity_tokens=1000 * (i + 1), running=i, prompt_tokens_total=100 * i) for i in range(4)]
    got = normalize_scrape(Scrape(0.0, T, None, render(engine, states, openmetrics=False)))
    assert [s.running for s in got] == [0, 1, 2, 3]
    assert [s.capacity_tokens for s in got] == [1000.0, 2000.0, 3000.0, 4000.0]
    wide = [s.provenance["prompt_tokens_total"].note.startswith("server-wide") for s in got]
    if engine == "sglang":  # the tokenizer's counter has no dp_rank: the server's total, on each
        assert [s.prompt_tokens_total for s in got] == [600.0] * 4 and all(wide)
    else:  # vLLM labels every engine's counter
        assert [s.prompt_tokens_total for s in got] == [0.0, 100.0, 200.0, 300.0] and not any(wide)


@pytest.mark.parametrize("openmetrics", [False, True], ids=["text", "openmetrics"])
@pytest.mark.parametrize("escaping", ESCAPINGS)
@pytest.mark.parametrize("fixture", ["sglang_fixture", "vllm_fixture"])
def test_every_escaping_scheme_reads_the_same_numbers(fixture: str, escaping: str, openmetrics: bool, request: pytest.FixtureRequest) -> None:
    text = request.getfixturevalue(fixture)
    [want] = _samples(text)
    body, content_type = reexpose(text, escaping, openmetrics)
    if escaping in ("dots", "values") and openmetrics:
        assert "sglang:token_usage{" not in body and "vllm:num_requests_running{" not in body  # really escaped
    [got] = _samples(body, content_type)
    for name in NUMERIC_FIELDS + HISTOGRAM_FIELDS + ("instance", "model", "labels"):
        assert getattr(got, name) == getattr(want, name), name
    assert {k: p.metric for k, p in got.provenance.items()} == {k: p.metric for k, p in want.provenance.items()}


def _sglang_pd(engine_type: str | None, **queues: float) -> PoolSample:
    from tests import dialects

    lbl = dialects.sglang_scheduler(engine_type or "")
    if engine_type is None:
        del lbl["engine_type"]
    old = queues.pop("old_bootstrap", None)
    metrics = [("sglang:num_running_reqs", "gauge", lbl, 10), ("sglang:num_queue_reqs", "gauge", lbl, 2),
               ("sglang:token_usage", "gauge", lbl, 0.5), *dialects.sglang_pd_queues(lbl, **queues)]
    if old is not None:  # <= 0.5.11 named the bootstrap queue "prefill prealloc"
        metrics = [m for m in metrics if m[0] != "sglang:num_prefill_bootstrap_queue_reqs"]
        metrics.append(("sglang:num_prefill_prealloc_queue_reqs", "gauge", lbl, old))
    [s] = _samples(dialects.expose(metrics))
    return s


def test_sglang_roles_and_their_queues() -> None:
    prefill = _sglang_pd("prefill", bootstrap=5, inflight=3)
    assert prefill.role == "prefill" and prefill.provenance["role"].metric == "sglang:num_running_reqs{engine_type}"
    # waiting: the waiting queue and the bootstrap queue; the inflight queue is prefilled work in flight
    assert (prefill.waiting, prefill.waiting_capacity, prefill.waiting_deferred, prefill.transfers_in_flight) == (7, 2, 5, 3)
    assert [(q.kind, q.requests) for q in prefill.queues] == [("capacity", 2), ("deferred", 5), ("in_flight", 3)]
    assert prefill.queues[1].metric == "sglang:num_prefill_bootstrap_queue_reqs"
    unified = _sglang_pd("unified")
    assert unified.role == "unified" and [q.name for q in unified.queues] == ["waiting queue"] and unified.waiting == 2
    # no engine_type label: a PD queue holding work says the role, derived
    guessed = _sglang_pd(None, prealloc=9)
    assert (guessed.role, guessed.provenance["role"].derived, guessed.waiting) == ("decode", True, 11)
    assert _sglang_pd(None).role is None  # all PD queues at 0: nothing says the role
    legacy = _sglang_pd("prefill", old_bootstrap=4)
    assert legacy.waiting_deferred == 4 and legacy.queues[1].metric == "sglang:num_prefill_prealloc_queue_reqs"


def test_sglang_mamba_pool_binds_in_states_and_single_pool_models_list_none() -> None:
    from tests import dialects

    lbl = dialects.sglang_scheduler("unified")
    body = dialects.expose([
        ("sglang:num_running_reqs", "gauge", lbl, 10), ("sglang:num_queue_reqs", "gauge", lbl, 0),
        ("sglang:token_usage", "gauge", lbl, 0.9), ("sglang:full_token_usage", "gauge", lbl, 0.4),
        ("sglang:swa_token_usage", "gauge", lbl, 0.0), ("sglang:mamba_usage", "gauge", lbl, 0.9),
        ("sglang:max_total_num_tokens", "gauge", lbl, 1000),
        ("sglang:mamba_used_tokens", "gauge", lbl, 90), ("sglang:mamba_evictable_tokens", "gauge", lbl, 4),
        ("sglang:mamba_available_tokens", "gauge", lbl, 6),
    ])
    [s] = _samples(body)
    assert [p.kind for p in s.pools] == ["full", "mamba"]  # the SWA gauge reads 0: no such pool
    binding = s.binding_pool
    assert binding is not None and (binding.kind, binding.unit, binding.capacity) == ("mamba", "states", 100)
    assert (s.used_tokens, s.evictable_tokens, s.available_tokens) == (90, 4, 6)
    [classic] = _samples(render("sglang", [_state()]))
    assert classic.pools == () and classic.binding_pool is None


def test_vllm_tiers_traffic_and_disk_hits() -> None:
    from tests import dialects

    lbl = dialects.vllm_engine()
    body = dialects.expose(dialects.vllm_core(lbl, 0.9, 10, 0, 0) + [
        ("vllm:kv_offload_total_bytes", "counter", {**lbl, "transfer_type": "CPU_to_GPU"}, 1e9),
        ("vllm:kv_offload_total_bytes", "counter", {**lbl, "transfer_type": "GPU_to_CPU"}, 5e9),
        ("vllm:prompt_tokens_cached_by_source", "counter", {**lbl, "source": "host"}, 700),
        ("vllm:prompt_tokens_cached_by_source", "counter", {**lbl, "source": "disk"}, 300),
        ("vllm:num_requests_kv_fetch_by_stage", "gauge", {**lbl, "stage": "in_progress"}, 2),
    ])
    [s] = _samples(body)
    assert (s.l2_load_bytes_total, s.l2_store_bytes_total, s.l2_tier) == (1e9, 5e9, "vLLM CPU offloading")
    assert s.provenance["l2_load_bytes_total"].metric == 'vllm:kv_offload_total_bytes_total{transfer_type="CPU_to_GPU"}'
    assert (s.l2_hit_tokens_total, s.l3_hit_tokens_total) == (700, 300)
    # a KV-fetch gauge beside a local tier: a kv_both connector also consumes, so no role is claimed
    assert s.role is None and s.transfers_in_flight == 2


def test_sglang_hicache_traffic_drops_and_storage_hits() -> None:
    from tests import dialects

    body = dialects.sglang_hicache(3)
    radix = {"cache_type": "HiRadixCache", "pp_rank": "0", "tp_rank": "0", "storage_backend": "file"}
    body += dialects.expose([("sglang:storage_prefetch_hit_tokens_total", "counter", radix, 1234)])  # another family
    [s] = _samples(body)
    assert (s.l2_used_tokens, s.l2_capacity_tokens, s.l2_tier) == (160_000, 800_000, "HiCache host-memory tier")
    assert (s.l2_load_bytes_total, s.l2_store_bytes_total, s.l2_dropped_tokens_total, s.l3_hit_tokens_total) == (1.2e8, 2.7e8, 0, 1234)
