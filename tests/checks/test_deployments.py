"""The deployments users run today, each through the CLI (``kvdiag diagnose FILE --json``) and the
committed rules (promtool, every 15 s step): a PD decode instance on each engine, a hybrid
sliding-window model, HiCache, LMCache on vLLM's /metrics, and a usage gauge written per process.

The expositions are written by prometheus_client under the engines' own names and labels
(``tests/dialects.py``). What this adds to CI: six 21-scrape stories, one CLI run each, the
exporter's columnar window on four, and one promtool run over all six (about 10 s on 2 cores).
"""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace
from pathlib import Path
from typing import Callable

import pytest

from kvdiag import cli
from kvdiag.checks import diagnose
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import Scrape
from kvdiag.refpool.sim import EPOCH
from kvdiag.server.ring import Ring
from kvdiag.sources.recording import write_recording
from kvdiag.window import windows
from tests import dialects
from tests.mixin.rule_tests import run_rule_tests
from tests.mixin.test_differential import INTERVAL, _group

STEPS = 21  # five minutes at 15 s: the checks' window
TARGET = "http://engine:8000"

STORIES: dict[str, tuple[str, Callable[[int], str]]] = {
    "sglang-decode": ("sglang", dialects.sglang_decode),
    "sglang-swa": ("sglang", dialects.sglang_swa),
    "sglang-hicache": ("sglang", dialects.sglang_hicache),
    "vllm-decode": ("vllm", dialects.vllm_decode),
    "vllm-lmcache": ("vllm", dialects.vllm_lmcache),
    "vllm-two-writers": ("vllm", dialects.vllm_two_writers),
}


def scrapes(story: str) -> list[Scrape]:
    _, body = STORIES[story]
    return [Scrape(EPOCH + (i + 1) * INTERVAL, TARGET, None, body(i)) for i in range(STEPS)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every story diagnosed once by the CLI, as its JSON instance."""
    tmp = tmp_path_factory.mktemp("deployments")
    out = {}
    for story in STORIES:
        path = tmp / f"{story}.jsonl.gz"
        write_recording(path, scrapes(story))
        out[story] = path
    return {story: _diagnose(path) for story, path in out.items()}


def _instances(path: Path) -> list[dict]:
    """``kvdiag diagnose --json --replay PATH``: its instances, each with the exit code."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["diagnose", "--json", "--replay", str(path)])
    out = json.loads(buf.getvalue())["instances"]
    for inst in out:
        inst["exit_code_cli"] = code
    return out


def _diagnose(path: Path) -> dict:
    (inst,) = _instances(path)
    return inst


def test_sglang_decode_instance_full_pool_is_the_l1_bottleneck_and_names_the_prealloc_queue(reports: dict[str, dict]) -> None:
    d = reports["sglang-decode"]
    assert (d["verdict"], d["exit_code_cli"], d["role"]) == ("l1_kv_bottleneck", 2, "decode")
    assert "decode instance of a disaggregated pair" in d["reason"] and "wants decode capacity" in d["reason"]
    q = d["checks"]["queue_growing"]["evidence"]
    # waiting = the waiting queue (0-2) + the prealloc queue (0 -> 70) + the transfer queue (4)
    assert (q["waiting_first"], q["waiting_last"]) == (4, 76)
    assert (q["waiting_capacity_first"], q["waiting_capacity_last"], q["waiting_deferred_last"]) == (0, 72, 4)
    assert "decode prealloc queue (waiting for room in this pool) 70" in q["summary"]
    assert "sglang:num_decode_prealloc_queue_reqs" in q["queues"]
    e = d["checks"]["evictions_growing"]["evidence"]
    assert e["recompute_tokens"] == pytest.approx(e["increase"] * 3_250, rel=0.06)  # 3,000 input + 250 output each
    assert e["recompute_tokens_per_eviction"] == pytest.approx(3_250) and "tokens thrown away" in e["summary"]


def test_vllm_decode_instance_queue_is_deferred_for_kv_transfer(reports: dict[str, dict]) -> None:
    d = reports["vllm-decode"]
    assert (d["verdict"], d["role"]) == ("queue_without_kv_pressure", "decode")
    assert "60 of the 60 waiting requests are deferred (waiting for their KV transfer) (0 wait for scheduling room)" in d["reason"]
    q = d["checks"]["queue_growing"]["evidence"]
    assert (q["waiting_capacity_last"], q["waiting_deferred_last"], q["transfers_in_flight_last"]) == (0, 60, 60)
    assert "KV fetch in progress 30" in q["summary"]


def test_hybrid_swa_model_names_the_binding_pool_and_shows_its_split(reports: dict[str, dict], tmp_path: Path) -> None:
    d = reports["sglang-swa"]
    assert d["verdict"] == "near_kv_capacity"
    s = d["checks"]["kv_usage_saturated"]["evidence"]
    assert s["binding_pool"] == "swa" and (s["swa_pool_usage"], s["full_pool_usage"]) == (0.99, 0.61)
    assert "the sliding-window pool is at 0.99 (binding); the full-attention pool at 0.61" in s["summary"]
    [last] = normalize_scrape(scrapes("sglang-swa")[-1])
    # the classic split is the binding (SWA) pool's, not the full pool's
    assert (last.used_tokens, last.evictable_tokens, last.available_tokens) == (79_200, 600, 200)
    assert last.provenance["evictable_tokens"].metric == "sglang:swa_evictable_tokens"


def test_l2_tiers_are_judged_on_what_they_export(reports: dict[str, dict]) -> None:
    hicache = reports["sglang-hicache"]["checks"]["l2_underused"]
    assert hicache["status"] == "firing"
    ev = hicache["evidence"]
    assert (ev["l2_tier"], ev["judged_on"], ev["l2_occupancy"]) == ("HiCache host-memory tier", "occupancy", 0.2)
    assert ev["l2_load_bytes_per_s"] == pytest.approx(4e7 / 15) and "loads 2.7 MB/s back" in ev["summary"]
    lmcache = reports["vllm-lmcache"]["checks"]["l2_underused"]
    ev = lmcache["evidence"]
    assert (lmcache["status"], ev["l2_tier"], ev["judged_on"]) == ("firing", "LMCache", "hits")
    assert ev["l2_hit_share"] == pytest.approx(0.02) and ev["l2_hit_share_of"] == "the tier's own lookups"
    assert "LMCache, exports no occupancy, judged from its hits, hits 2.0% of the tier's own lookups" in ev["summary"]


def test_vllm_recompute_cost_and_admission_rejections_are_evidence(reports: dict[str, dict]) -> None:
    d = reports["vllm-lmcache"]
    e = d["checks"]["evictions_growing"]["evidence"]
    assert e["preemptions_per_finished_request"] == pytest.approx(0.45)
    assert e["finished_preempted_twice_or_more"] == pytest.approx(0.2)
    assert "0.45 preemptions per finished request, 20% of them preempted twice or more" in e["summary"]
    q = d["checks"]["queue_growing"]["evidence"]
    assert q["admission_rejections"] == 40 and "40 requests rejected at admission" in q["summary"]


def test_per_process_usage_reads_the_most_recent_writer(reports: dict[str, dict]) -> None:
    """pid 101 wrote 0.97 and stopped, pid 102 keeps writing: the pool is at 0.30-0.34, not 0.97."""
    d = reports["vllm-two-writers"]
    assert d["verdict"] == "healthy"
    s = d["checks"]["kv_usage_saturated"]["evidence"]
    assert s["usage_last"] == pytest.approx(0.34) and s["usage_short_min"] == pytest.approx(0.32)
    assert "pid 102 changed its value most recently" in s["sources"]["usage_ratio"]
    (w,) = windows([x for sc in scrapes("vllm-two-writers") for x in normalize_scrape(sc)]).values()
    # only the first scrape, before any process changed its value, is ambiguous (the max)
    assert list(w.column("usage_ratio")) == pytest.approx([0.97] + [0.30 + 0.02 * (i % 3) for i in range(1, STEPS)])


def test_two_processes_that_wrote_09_then_03_read_as_03_with_the_used_tokens_that_follow() -> None:
    def body(a: float, b: float) -> str:
        lbl = dialects.vllm_engine()
        return dialects.expose(dialects.vllm_core(lbl, {"101": a, "102": b}, 3, 0, 0))

    one = normalize_scrape(Scrape(0.0, TARGET, None, body(0.9, 0.1)))
    two = normalize_scrape(Scrape(15.0, TARGET, None, body(0.9, 0.3)))
    (single,) = windows(list(one)).values()
    assert single.last.usage_ratio == 0.9  # one scrape: no history says who wrote last
    assert "ambiguous: the max is taken" in single.last.provenance["usage_ratio"].note
    (w,) = windows(one + two).values()
    assert list(w.column("usage_ratio")) == [0.9, 0.3]
    # used tokens (usage x capacity) follow the writer taken, in the CLI's window and the exporter's columns
    capacity = w.last.capacity_tokens
    assert capacity == 196_592 and list(w.column("used_tokens")) == [0.9 * capacity, 0.3 * capacity]
    assert "from pid 102's usage_ratio (most recent writer)" in w.last.provenance["used_tokens"].note
    ring = Ring(4)
    for scrape in (Scrape(0.0, TARGET, None, body(0.9, 0.1)), Scrape(15.0, TARGET, None, body(0.9, 0.3))):
        ring.append(*normalize_scrape(scrape))
    assert list(ring.window(w.instance).column("used_tokens")) == [0.9 * capacity, 0.3 * capacity]  # type: ignore[union-attr]


def test_rules_equal_python_on_every_deployment(tmp_path: Path) -> None:
    """The committed rules give the Python checks' statuses and verdict at every 15 s step."""
    groups = [_group(SimpleNamespace(name=story, engine=engine, dialect="0.33.0" if engine == "vllm" else "0.5.23",  # type: ignore[arg-type]
                                     bodies=tuple(s.body for s in scrapes(story))))
              for story, (engine, _) in STORIES.items()]
    assert sum(len(t["exp_samples"]) for g in groups for t in g["promql_expr_test"]) > 6 * 20 * 4  # not vacuous
    run_rule_tests(groups, tmp_path, "deployments")


@pytest.mark.parametrize("story", ["sglang-decode", "vllm-decode", "sglang-swa", "vllm-two-writers"])
def test_the_exporters_columnar_window_gives_the_same_answer(story: str, reports: dict[str, dict]) -> None:
    """The exporter keeps columns, not samples (``server/ring.py``): the per-process usage is
    resolved as each scrape arrives, and the verdict and evidence match the CLI's."""
    ring = Ring(64)
    for scrape in scrapes(story):
        (sample,) = normalize_scrape(scrape)
        ring.append(sample)
    window = ring.window(ring.latest.instance)  # type: ignore[union-attr]
    assert window is not None
    d = diagnose(window, Config())
    assert d.verdict.name == reports[story]["verdict"] and d.role == reports[story]["role"]
    for check in ("kv_usage_saturated", "queue_growing"):
        assert d.checks[check].evidence.summary == reports[story]["checks"][check]["evidence"]["summary"]


def test_lmcache_on_its_own_target_joins_the_vllm_instance_of_its_model(tmp_path: Path) -> None:
    """LMCache's own /metrics is a second target: its series join the vLLM instance serving the
    same model on the same host; alone, it is reported, not lost, and says what it needs."""
    def engine(i: int) -> str:
        return dialects.expose(dialects.vllm_core(dialects.vllm_engine(), 0.97 + 0.01 * (i % 2), 48, 0, 3 * i))

    def tier(i: int) -> str:
        lm = {"model_name": dialects.VL_MODEL, "role": "worker", "served_model_name": dialects.VL_MODEL, "worker_id": "0"}
        return dialects.expose(dialects.lmcache_counters(lm, 100_000 * i, 30_000 * i, 2_000 * i))

    both = []
    for i in range(STEPS):
        both.append(Scrape(EPOCH + (i + 1) * INTERVAL, "http://10.0.0.7:8000", None, engine(i)))
        both.append(Scrape(EPOCH + (i + 1) * INTERVAL + 0.3, "http://10.0.0.7:6999", None, tier(i)))
    path = tmp_path / "pair.jsonl.gz"
    write_recording(path, both)
    (d,) = _instances(path)
    ev = d["checks"]["l2_underused"]["evidence"]
    assert (d["checks"]["l2_underused"]["status"], ev["l2_tier"], ev["l2_hit_share"]) == ("firing", "LMCache", pytest.approx(0.02))
    assert "joined by model from http://10.0.0.7:6999" in ev["sources"]["l2_hit_tokens_total"]
    alone = tmp_path / "alone.jsonl.gz"
    write_recording(alone, [s for s in both if s.target.endswith(":6999")])
    (d,) = _instances(alone)
    assert d["verdict"] == "unknown" and any("add that vLLM server as a target" in n for n in d["notes"])
