"""Scheduler-level differential: the reference pool against the engines' own Scheduler classes.

vLLM 0.33.0's ``Scheduler`` and SGLang 0.5.23's ``Scheduler`` run on CPU in a separate
virtualenv (``scripts/oracle-env.sh``, which ``make test`` runs) through the drivers in
``scripts/oracle/``; the reference schedulers run the same request traces in this process. After
every step both sides' state is compared: running and waiting ids in order, the pool's free /
available, evictable and protected counts, usage, cumulative preemptions / retractions,
new_token_ratio, prefix hits and queries, and per scheduled request its tokens and its block
table (vLLM block ids / SGLang req_to_token slots). With an L2 tier also: vLLM CPU offloading's
cumulative blocks loaded and stored, its connector's prefix queries and hits and the CPU blocks in
use; SGLang HiCache's host tokens in use and cumulative backup and load-back tokens (evictable and
protected already include the nodes locked while their copies await the ack). A failure prints
the first divergent step with both sides' fields. A known divergence is a strict xfail with its
reason (``KNOWN_DIVERGENCES``): fixing it fails the mark.

One oracle process per engine runs all of its stories (importing an engine costs ~8 s). Without
the oracle environment the tests skip with the reason; under ``CI=true`` they fail.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.types import EngineScheduler, SimRequest, StepPlan, output_ids
from kvdiag.refpool.vllm.scheduler import VLLMScheduler

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PYTHON = Path(os.environ.get("KVDIAG_ORACLE_PYTHON", ROOT / ".cache/oracle-venv/bin/python"))
DRIVERS = {"vllm": ROOT / "scripts/oracle/vllm_driver.py", "sglang": ROOT / "scripts/oracle/sglang_driver.py"}


@dataclass
class Story:
    """One request trace and the engine configuration it runs under."""

    name: str
    config: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)  # rid, step, prompt, output


def make_requests(
    seed: int, n: int, every: int, prompt: tuple[int, int], output: tuple[int, int], shared_prefix: int = 0
) -> list[dict[str, Any]]:
    """``n`` requests, one every ``every`` steps, with uniform prompt and output lengths; the
    first ``shared_prefix`` prompt tokens are common to all (prefix hits)."""
    rng = random.Random(seed)
    common = [rng.randrange(1, 30000) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        rid = f"s{seed}-r{i}"
        p = common + [rng.randrange(1, 30000) for _ in range(rng.randint(*prompt) - shared_prefix)]
        out.append({"rid": rid, "step": i * every, "prompt": p, "output": output_ids(rid, rng.randint(*output))})
    return out


def make_prefix_groups(
    seed: int, n: int, every: int, groups: int, prefix: int, suffix: tuple[int, int], output: tuple[int, int]
) -> list[dict[str, Any]]:
    """``n`` requests, one every ``every`` steps, cycling over ``groups`` distinct ``prefix``-token
    prompt prefixes (then their own ``suffix`` tokens): when the groups' prefixes together outgrow
    L1, each group's prefix is evicted from it before the group comes round again (an L2 hit)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 30000) for _ in range(prefix)] for _ in range(groups)]
    out = []
    for i in range(n):
        rid = f"s{seed}-r{i}"
        p = heads[i % groups] + [rng.randrange(1, 30000) for _ in range(rng.randint(*suffix))]
        out.append({"rid": rid, "step": i * every, "prompt": p, "output": output_ids(rid, rng.randint(*output))})
    return out


# ------------------------------------------------------------------------------------ vLLM
DRIVER_KV_BYTES_PER_TOKEN = 8  # the vLLM driver's KV spec: K and V, one head of size 1, float32


def vllm_config(**kw: Any) -> dict[str, Any]:
    cfg = {"block_size": 16, "num_gpu_blocks": 64, "max_num_seqs": 64, "max_num_batched_tokens": 256,
           "long_prefill_token_threshold": 0}  # fmt: skip
    cfg.update(kw)
    cfg.setdefault("max_model_len", (cfg["num_gpu_blocks"] - 1) * cfg["block_size"])
    return cfg


VLLM_STORIES = [
    Story("ramp", vllm_config(), make_requests(1, 40, 2, (30, 120), (20, 90))),
    Story("near_capacity", vllm_config(num_gpu_blocks=96), make_requests(2, 30, 4, (40, 100), (20, 60))),
    Story("long_outputs", vllm_config(), make_requests(3, 16, 3, (10, 40), (150, 300))),
    Story("chunked_long_prompts", vllm_config(num_gpu_blocks=128, max_num_batched_tokens=96),
          make_requests(4, 12, 5, (200, 600), (5, 30))),
    Story("shared_prefixes", vllm_config(), make_requests(5, 30, 2, (60, 120), (10, 50), shared_prefix=48)),
    Story("long_prefill_threshold", vllm_config(num_gpu_blocks=128, long_prefill_token_threshold=40),
          make_requests(6, 16, 6, (50, 300), (5, 40))),
    Story("max_num_seqs", vllm_config(num_gpu_blocks=128, max_num_seqs=4), make_requests(7, 20, 1, (20, 80), (10, 40))),
    # CPU offloading (OffloadingConnector, CPU backend) with a sync-load budget covering every hit:
    # a CPU hit is copied into its freshly allocated GPU blocks before that step's forward.
    Story("cpu_offloading", vllm_config(cpu_blocks=160, sync_load_budget_bytes=1 << 30),
          make_prefix_groups(8, 36, 3, 6, 160, (10, 60), (10, 40))),
    # The default (no sync-load budget): every CPU hit loads asynchronously, the request parked in
    # WAITING_FOR_REMOTE_KVS (blocks held, in-flight prefills' blocks kept free) until its load lands.
    Story("cpu_offloading_async", vllm_config(cpu_blocks=160), make_prefix_groups(8, 36, 3, 6, 160, (10, 60), (10, 40))),
]  # fmt: skip
KNOWN_DIVERGENCES: dict[str, str] = {}  # story -> why the reference departs from the engine (strict xfail)


def marked(stories: list[Story]) -> list[Any]:
    """The stories as test parameters, a known divergence as a strict xfail."""
    return [
        pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=KNOWN_DIVERGENCES[s.name]))
        if s.name in KNOWN_DIVERGENCES else s
        for s in stories
    ]  # fmt: skip


def vllm_reference(story: Story) -> Iterator[dict[str, Any]]:
    """The reference ``VLLMScheduler`` over ``story``, in the driver's step record."""
    c = story.config
    s = VLLMScheduler(
        c["num_gpu_blocks"], c["block_size"], c["max_num_batched_tokens"], c["max_num_seqs"], c["max_model_len"],
        long_prefill_token_threshold=c["long_prefill_token_threshold"], kv_offloading_blocks=c.get("cpu_blocks", 0),
        kv_offloading_sync_load_tokens=c.get("sync_load_budget_bytes", 0) // DRIVER_KV_BYTES_PER_TOKEN, debug=True,
    )  # fmt: skip
    kv = s.kv_cache_manager
    moved = {"offload_loaded_blocks": 0, "offload_stored_blocks": 0}

    def before(plan: StepPlan) -> dict[str, Any]:
        scheduled = {ch.req.rid: ch.num_new_tokens for ch in plan.chunks}
        moved["offload_loaded_blocks"] += plan.loaded_tokens // c["block_size"]
        moved["offload_stored_blocks"] += plan.stored_tokens // c["block_size"]
        return {"scheduled": scheduled, "blocks": {rid: [b.block_id for b in kv.get_blocks(rid)] for rid in scheduled}}

    def after() -> dict[str, Any]:
        st = s.stats()
        offload = {
            **moved, "external_queries": st.external_prefix_cache_queries_total,
            "external_hits": st.external_prefix_cache_hits_total, "cpu_used_blocks": st.cpu_offload_used_blocks,
        } if c.get("cpu_blocks") else {}  # fmt: skip
        return {
            "running": [r.request_id for r in s.running], "waiting": [r.request_id for r in s.waiting],
            "free_blocks": st.num_free_blocks, "usage": round(st.kv_cache_usage, 12),
            "preemptions": st.num_preemptions_total,
            "prefix_queries": st.prefix_cache_queries_total, "prefix_hits": st.prefix_cache_hits_total, **offload,
        }  # fmt: skip

    return drive(story, s, True, before, after)


# ------------------------------------------------------------------------------------ SGLang
def sglang_config(**kw: Any) -> dict[str, Any]:
    cfg = {"max_total_num_tokens": 1200, "page_size": 1, "max_running_requests": 64, "context_len": 4096,
           "chunked_prefill_size": 256, "max_prefill_tokens": 16384, "schedule_conservativeness": 1.0,
           "ignore_eos": False, "clip_max_new_tokens": 4096}  # fmt: skip
    cfg.update(kw)
    return cfg


SGLANG_STORIES = [
    Story("ramp", sglang_config(), make_requests(11, 40, 2, (30, 120), (20, 90))),
    Story("near_capacity", sglang_config(max_total_num_tokens=1600), make_requests(12, 30, 4, (40, 100), (20, 60))),
    Story("long_outputs", sglang_config(), make_requests(13, 16, 3, (10, 40), (150, 300))),
    Story("chunked_long_prompts", sglang_config(max_total_num_tokens=2400, chunked_prefill_size=96),
          make_requests(14, 12, 5, (200, 600), (5, 30))),
    Story("shared_prefixes", sglang_config(), make_requests(15, 30, 2, (60, 120), (10, 50), shared_prefix=48)),
    Story("max_running_requests", sglang_config(max_total_num_tokens=2400, max_running_requests=4),
          make_requests(17, 20, 1, (20, 80), (10, 40))),
    Story("conservativeness", sglang_config(schedule_conservativeness=0.3), make_requests(18, 40, 2, (30, 120), (20, 90))),
    Story("retractions", sglang_config(schedule_conservativeness=0.1), make_requests(21, 24, 1, (20, 60), (150, 300))),
    Story("ignore_eos", sglang_config(ignore_eos=True), make_requests(19, 30, 2, (30, 120), (20, 90))),
    # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION=64: admission charges at most 64 output tokens a
    # request, over-commits long outputs and retracts (the real sglang-overcommit story)
    Story("clip_max_new_tokens", sglang_config(clip_max_new_tokens=64), make_requests(26, 24, 1, (20, 60), (150, 300))),
    # Bursts with idle spells between them: the step that finishes a burst's last request still
    # holds the decayed new_token_ratio, the next idle iteration resets it (on_idle).
    Story("idle_spells", sglang_config(), [
        {**r, "step": r["step"] + 150 * burst} for burst in range(3)
        for r in make_requests(25 + burst, 8, 1, (30, 120), (20, 90))]),
    Story("page_size_16", sglang_config(page_size=16, max_total_num_tokens=1600), make_requests(20, 30, 2, (30, 120), (20, 90))),
    # HiCache: six 160-token prefixes outgrow L1 (1200 tokens) but fit L2 (2x): each group's
    # prefix is demoted to host before the group comes round again and is loaded back.
    Story("hicache_write_through", sglang_config(hicache_write_policy="write_through", hicache_ratio=2.0),
          make_prefix_groups(22, 36, 3, 6, 160, (10, 60), (10, 40))),
    Story("hicache_write_back", sglang_config(hicache_write_policy="write_back", hicache_ratio=2.0),
          make_prefix_groups(23, 36, 3, 6, 160, (10, 60), (10, 40))),
    Story("hicache_write_through_selective", sglang_config(hicache_write_policy="write_through_selective", hicache_ratio=2.0),
          make_prefix_groups(24, 36, 3, 6, 160, (10, 60), (10, 40))),
]  # fmt: skip


def sglang_reference(story: Story) -> Iterator[dict[str, Any]]:
    """The reference ``SGLangScheduler`` over ``story``, in the driver's step record."""
    c = story.config
    s = SGLangScheduler(
        c["max_total_num_tokens"], c["page_size"], c["max_running_requests"], c["context_len"],
        c["chunked_prefill_size"], c["max_prefill_tokens"], c["schedule_conservativeness"],
        enable_hierarchical_cache=bool(c.get("hicache_write_policy")), hicache_ratio=c.get("hicache_ratio", 2.0),
        hicache_write_policy=c.get("hicache_write_policy", "write_through"), debug=True,
        clip_max_new_tokens=c["clip_max_new_tokens"],
    )  # fmt: skip

    def before(plan: StepPlan) -> dict[str, Any]:
        return {
            "scheduled": {ch.req.rid: ch.num_new_tokens for ch in plan.chunks},
            "slots": {ch.req.rid: list(s.reqs[ch.req].kv_indices) for ch in plan.chunks},
        }

    def after() -> dict[str, Any]:
        st = s.stats()
        return {
            "waiting": [r.sim.rid for r in s.waiting_queue],
            "available": st.kv_available_tokens, "evictable": st.kv_evictable_tokens,
            "protected": st.kv_protected_tokens, "retractions": st.num_retracted_requests_total,
            "new_token_ratio": round(st.new_token_ratio, 12),
            "prefix_hits": st.prefill_cache_tokens_total, "prefill_inputs": st.prefill_compute_tokens_total,
            **({
                "host_used": st.hicache_host_used_tokens, "backup_tokens": st.hicache_backup_tokens_total,
                "load_back_tokens": st.load_back_tokens_total,
            } if c.get("hicache_write_policy") else {}),
        }  # fmt: skip

    return drive(story, s, c["ignore_eos"], before, after)


# ------------------------------------------------------------------------------------ harness
def drive(
    story: Story,
    s: EngineScheduler,
    ignore_eos: bool,
    before: Callable[[StepPlan], dict[str, Any]],
    after: Callable[[], dict[str, Any]],
) -> Iterator[dict[str, Any]]:
    """Steps of a reference scheduler over ``story`` as the drivers step the engines: the
    requests of step ``n`` arrive before its ``schedule``; ``before`` reads what was scheduled
    (block tables before finished requests release them), ``after`` the state after the step."""
    arrivals: dict[int, list[dict[str, Any]]] = {}
    for r in story.requests:
        arrivals.setdefault(r["step"], []).append(r)
    step, last = 0, max(arrivals)
    while step <= last or s.has_work():
        for r in arrivals.get(step, []):
            n = len(r["output"])
            s.add_request(SimRequest(r["rid"], float(step), tuple(r["prompt"]), n, n, ignore_eos))
        plan = s.schedule(float(step))
        scheduled = before(plan)
        s.update_from_output(plan, float(step))
        yield {"story": story.name, "step": step, **scheduled, **after()}
        step += 1


def run_oracle(engine: str, stories: list[Story]) -> dict[str, list[dict[str, Any]]]:
    """All of ``engine``'s stories through its own scheduler, in one process; records by story."""
    if not ORACLE_PYTHON.exists():
        msg = f"no oracle environment at {ORACLE_PYTHON}: run `bash scripts/oracle-env.sh` (`make test` does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    trace = json.dumps({"stories": [{"name": s.name, "config": s.config, "requests": s.requests} for s in stories]})
    proc = subprocess.run(
        [str(ORACLE_PYTHON), str(DRIVERS[engine])], input=trace, capture_output=True, text=True, timeout=900, cwd=ROOT
    )  # hang guard only
    assert proc.returncode == 0, f"{engine} oracle failed:\n{proc.stderr[-6000:]}"
    records: dict[str, list[dict[str, Any]]] = {s.name: [] for s in stories}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            records[rec["story"]].append(rec)
    return records


def assert_same_steps(engine: str, oracle: list[dict[str, Any]], reference: Iterator[dict[str, Any]]) -> int:
    """Compare step by step; fail at the first divergent step showing both sides' fields."""
    n = 0
    for n, (want, got) in enumerate(zip(oracle, reference, strict=False), start=1):
        if want != got:
            diff = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
            pytest.fail(
                f"{want['story']}: first divergence at step {want['step']} in {diff}\n"
                f"  {engine}:     {json.dumps({k: want.get(k) for k in diff})}\n"
                f"  reference: {json.dumps({k: got.get(k) for k in diff})}\n"
                f"  {engine} step:     {json.dumps(want)}\n  reference step: {json.dumps(got)}"
            )
    rest = list(reference)
    assert not rest and n == len(oracle), f"step counts differ: {engine} {len(oracle)}, reference {n + len(rest)}"
    assert n > 0
    return n


@pytest.fixture(scope="module")
def vllm_oracle() -> dict[str, list[dict[str, Any]]]:
    return run_oracle("vllm", VLLM_STORIES)


@pytest.mark.parametrize("story", marked(VLLM_STORIES), ids=lambda s: s.name)
def test_vllm_reference_equals_vllm_scheduler_every_step(story: Story, vllm_oracle: dict[str, list[dict[str, Any]]]) -> None:
    assert_same_steps("vllm", vllm_oracle[story.name], vllm_reference(story))


@pytest.fixture(scope="module")
def sglang_oracle() -> dict[str, list[dict[str, Any]]]:
    return run_oracle("sglang", SGLANG_STORIES)


@pytest.mark.parametrize("story", marked(SGLANG_STORIES), ids=lambda s: s.name)
def test_sglang_reference_equals_sglang_scheduler_every_step(
    story: Story, sglang_oracle: dict[str, list[dict[str, Any]]]
) -> None:
    assert_same_steps("sglang", sglang_oracle[story.name], sglang_reference(story))


