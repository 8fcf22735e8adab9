"""The reference vLLM's CPU offloading traffic reaches its exposition as vLLM 0.33.0 writes it
(the OffloadingConnector's ``kv_offload_{load,store}_bytes``), equal to what its scheduler
copied, and the adapters read it back as the L2's traffic."""

from __future__ import annotations

from kvdiag.engines import normalize_scrape
from kvdiag.model import Scrape
from kvdiag.refpool.deployments import unified_metrics
from kvdiag.refpool.emit import VLLM_DIALECTS, render
from kvdiag.refpool.roofline import Roofline
from kvdiag.refpool.sim import Simulation
from kvdiag.refpool.vllm.scheduler import VLLMScheduler
from kvdiag.refpool.workload import Fixed, Poisson, SharedPrefix, Workload

BYTES = 131_072  # KV bytes per token on one rank


def _run(kv_bytes: int | None) -> tuple[Simulation, str]:
    blocks = 3000 // 16 + 1
    make = lambda: VLLMScheduler(num_gpu_blocks=blocks, kv_offloading_blocks=blocks)  # noqa: E731
    wl = Workload(Poisson(10), Fixed(300), Fixed(40), prefix=SharedPrefix(12, 0.8), seed=4)
    sim = Simulation(make, wl.requests(), Roofline("llama-3-8b").step_time, metrics=unified_metrics(kv_bytes)).run(8)
    return sim, render("vllm", [sim.state()], "0.33.0")


def test_offload_bytes_are_the_tokens_the_scheduler_copied() -> None:
    sim, body = _run(BYTES)
    steps = sim.steps.arrays()
    stored, loaded = int(steps["stored_tokens"].sum()), int(steps["loaded_tokens"].sum())
    assert stored > 0 and loaded > 0  # prompts offloaded, prefixes loaded back from CPU
    (sample,) = normalize_scrape(Scrape(0.0, "http://127.0.0.1:8000", None, body))
    assert sample.l2_store_bytes_total == stored * BYTES
    assert sample.l2_load_bytes_total == loaded * BYTES


def test_unknown_kv_bytes_write_no_byte_counters() -> None:
    """Without the KV size per token the bytes are unknown: absent, never written as 0."""
    _, body = _run(None)
    assert "kv_offload_store_bytes" not in body
    (sample,) = normalize_scrape(Scrape(0.0, "http://127.0.0.1:8000", None, body))
    assert sample.l2_store_bytes_total is None and sample.l2_load_bytes_total is None


def test_older_releases_write_none() -> None:
    """Only 0.33.0's connector metrics are known (facts §1.7): older dialects stay without them."""
    sim, _ = _run(BYTES)
    older = [d for d in VLLM_DIALECTS if d != "0.33.0"]
    assert older
    for dialect in older:
        assert "kv_offload_" not in render("vllm", [sim.state()], dialect), dialect
