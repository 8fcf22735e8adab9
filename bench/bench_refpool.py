"""Reference-pool speed: simulated seconds per wall second, against the step-by-step pool, in one run.

The engine loop: a 1.5 M-token pool (Llama-3-8B step times on an H200) under 50 req/s of
chat load (1k-token prompts, half shared with one of 8 system prompts, ~800-token answers, so
about a thousand requests run at once), accounting-only (``NullStore``), at ``sim.tune_gc()``'s
thresholds as the simulate and validate commands run. The engine first warms up to its steady
state (not timed), then runs ``--seconds`` simulated seconds (timed). Each engine runs twice in
one run: step by step (the baseline: the path the oracle differential and debug runs take, one
``schedule`` / ``update_from_output`` with a chunk per running request per step) and fast
(what ``Simulation`` does given a batch step time: batch-level decode accounting and the
exact decode-run fast-forward), and the ratio is printed. With the compiled build in use
(kvdiag/refpool/native.py), the fast figure is also taken in the pure build (the same sources,
not compiled) in a child process of the same run, and that ratio is printed too. Goal (issue 18):
360 simulated s per wall s, a one-hour ``kvdiag whatif`` (calibration + five remedies) in a
minute on 2 cores.

Where the rest goes: every request, whatever the scheduler does, has to be drawn, get its
answer's token ids, be looked up in the prefix cache, take slots, be cached when it finishes
and be released (the request path, timed through the pool's own classes with no scheduling at
all); at 50 req/s that alone bounds the speed (at 360x the whole budget is 55 us per request).
The pool operations: SGLang's radix tree (match_prefix + insert + lock/unlock, with LRU
eviction) and vLLM's block pool (get_new_blocks + cache + touch + free_blocks), per second.

Usage: .venv/bin/python bench/bench_refpool.py [--seconds 60] [--warmup 40] [--engine sglang|vllm] [--fast-only]
Last line: JSON with the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

from builds import in_pure_build, this_build
from kvdiag.refpool.roofline import Roofline
from kvdiag.refpool.sglang.allocator import TokenToKVPoolAllocator
from kvdiag.refpool.sglang.radix_cache import RadixCache
from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.sim import Simulation, tune_gc
from kvdiag.refpool.vllm.block_pool import BlockPool
from kvdiag.refpool.vllm.kv_cache_manager import KVCacheManager
from kvdiag.refpool.vllm.request import Request
from kvdiag.refpool.types import SimRequest
from kvdiag.refpool.vllm.scheduler import VLLMScheduler
from kvdiag.refpool.workload import LogNormal, Poisson, SharedPrefix, Workload, expected_output

POOL_TOKENS = 1_500_000
RATE = 50.0


def engine_speed(engine: str, warmup: float, seconds: float, fast: bool = True) -> dict[str, float]:
    """Simulated seconds per wall second over ``seconds`` after ``warmup`` (both simulated);
    ``fast``: with the batch step time (batch-level decode, decode-run fast-forward)."""
    wl = _bench_workload()
    if engine == "sglang":
        make = lambda: SGLangScheduler(max_total_num_tokens=POOL_TOKENS)  # noqa: E731
    else:
        make = lambda: VLLMScheduler(num_gpu_blocks=POOL_TOKENS // 16 + 1)  # noqa: E731
    roofline = Roofline("llama-3-8b", "h200")
    sim = Simulation(make, wl.requests(), roofline.step_time, batch_time=roofline.batch_seconds if fast else None)
    t_start = time.perf_counter()
    sim.run_until(warmup)
    steps0 = len(sim.steps.start)
    t0 = time.perf_counter()
    sim.run_until(warmup + seconds)
    wall = time.perf_counter() - t0
    steps = len(sim.steps.start) - steps0
    return {
        "sim_per_wall": seconds / wall,
        "sim_per_wall_from_empty": (warmup + seconds) / (time.perf_counter() - t_start),
        "steps_per_s": steps / wall,
        "running": float(sim.steps.running[-1]),
        "wall_s": wall,
    }


def _bench_workload() -> Workload:
    return Workload(Poisson(RATE), LogNormal(1000, 0.5, hi=8000), LogNormal(800, 0.5, hi=4000), prefix=SharedPrefix(8, 0.5), seed=1)


def request_path_seconds(engine: str, n: int = 3_000) -> tuple[float, float]:
    """Wall seconds per request (draw, pool path) of the work the reference pool does for each
    request whatever the scheduler does: draw it from the workload; then give it its answer's
    token ids, look its prompt up in the pool, take slots for prompt + answer, cache the finished
    sequence and release it (evicting as the pool fills), through the pool's own classes with
    no scheduling at all (the empty pool is built before the clock starts)."""
    t0 = time.perf_counter()
    requests = list(itertools.islice(_bench_workload().requests(), n))
    t_draw = time.perf_counter() - t0
    if engine == "sglang":
        alloc = TokenToKVPoolAllocator(POOL_TOKENS)
        tree = RadixCache(alloc)
        t0 = time.perf_counter()
        for req in requests:
            key = req.prompt + expected_output(req)
            m = tree.match_prefix(req.prompt)
            tree.inc_lock_ref(m.last_device_node)
            hit = len(m.device_indices)
            tree.evict_to_free_tokens(len(key) - hit)
            slots = alloc.alloc(len(key) - hit)
            assert slots is not None
            done = tree.insert(key, m.device_indices + slots)
            if done > hit:
                alloc.free(slots[: done - hit])
            tree.dec_lock_ref(m.last_device_node)
    else:
        kv = KVCacheManager(BlockPool(POOL_TOKENS // 16 + 1), 16)
        t0 = time.perf_counter()
        for req in requests:
            req.output.extend(expected_output(req))
            request = Request(req, 16, track_keys=False)
            hits, num_hits = kv.get_computed_blocks(request)
            assert kv.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits) is not None
            kv.free(request)
    return t_draw / n, (time.perf_counter() - t0) / n


def radix_ops(n: int = 20_000) -> float:
    """match_prefix + insert + inc/dec_lock_ref cycles per second on a pool that must evict."""
    rng = random.Random(0)
    alloc = TokenToKVPoolAllocator(200_000)
    tree = RadixCache(alloc)
    prefixes = [tuple(rng.randrange(1 << 17) for _ in range(200)) for _ in range(16)]
    t0 = time.perf_counter()
    for _ in range(n):
        key = prefixes[rng.randrange(16)] + tuple(rng.randrange(1 << 17) for _ in range(50))
        m = tree.match_prefix(key)
        tree.inc_lock_ref(m.last_device_node)
        need = len(key) - len(m.device_indices)
        tree.evict_to_free_tokens(need)
        slots = alloc.alloc(need)
        assert slots is not None
        done = tree.insert(key, m.device_indices + slots)
        if done > len(m.device_indices):
            alloc.free((m.device_indices + slots)[len(m.device_indices) : done])
        tree.dec_lock_ref(m.last_device_node)
    return 4 * n / (time.perf_counter() - t0)  # four tree operations per cycle


def block_pool_ops(n: int = 20_000) -> float:
    """get_new_blocks + cache_full_blocks + touch + free_blocks cycles per second."""
    pool = BlockPool(20_001)
    reqs = [Request(SimRequest(f"r{i}", 0.0, tuple(range(i, i + 64)), 1, 1), 16) for i in range(64)]
    t0 = time.perf_counter()
    for i in range(n):
        req = reqs[i % 64]
        hit = [b for b in (pool.get_cached_block(h) for h in req.block_hashes[:2]) if b is not None]
        pool.touch(hit)
        blocks = hit + pool.get_new_blocks(4 - len(hit))
        pool.cache_full_blocks(req, blocks, len(hit), 4, 16)
        pool.free_blocks(reversed(blocks))
    return 4 * n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="simulated seconds timed (default 60)")
    p.add_argument("--warmup", type=float, default=40.0, help="simulated seconds before timing (default 40)")
    p.add_argument("--engine", action="append", choices=("sglang", "vllm"), help="engine(s) to time (default both)")
    p.add_argument("--fast-only", action="store_true", help="time the fast pool only (the pure build's side of a run)")
    args = p.parse_args()
    build = this_build()
    out: dict[str, object] = {"pool_tokens": POOL_TOKENS, "rate": RATE, "build": build}
    tune_gc()  # as `kvdiag simulate` and `kvdiag validate` run
    engines = args.engine or ("sglang", "vllm")
    if args.fast_only:
        print(json.dumps(out | {e: engine_speed(e, args.warmup, args.seconds, fast=True) for e in engines}))
        return
    for engine in engines:
        base = engine_speed(engine, args.warmup, args.seconds, fast=False)
        r = engine_speed(engine, args.warmup, args.seconds, fast=True)
        r["step_by_step_sim_per_wall"] = base["sim_per_wall"]
        r["speedup"] = r["sim_per_wall"] / base["sim_per_wall"]
        out[engine] = r
        print(
            f"{engine} ({build}): {r['sim_per_wall']:.1f} simulated s per wall s in steady state ({r['steps_per_s']:.0f} steps/s, "
            f"{r['running']:.0f} running), {r['sim_per_wall_from_empty']:.1f} from an empty pool; "
            f"{r['speedup']:.2f}x the step-by-step pool in the same run ({base['sim_per_wall']:.1f})"
        )
        if build == "compiled":
            pure = in_pure_build(__file__, ["--fast-only", "--engine", engine, "--seconds", str(args.seconds), "--warmup", str(args.warmup)])
            pure_speed = pure[engine]["sim_per_wall"]  # type: ignore[index]
            r["pure_sim_per_wall"], r["compiled_speedup"] = pure_speed, r["sim_per_wall"] / pure_speed
            print(f"  the pure build, same run: {pure_speed:.1f} simulated s per wall s ({r['compiled_speedup']:.2f}x compiled)")
    for engine in engines:
        r = out[engine]
        t_draw, t_path = request_path_seconds(engine)
        r.update(draw_us=t_draw * 1e6, pool_path_us=t_path * 1e6, ceiling_sim_per_wall=1 / (RATE * (t_draw + t_path)))
        print(
            f"{engine} request path: {t_draw * 1e6:.0f} us to draw a request, {t_path * 1e6:.0f} us through the pool: "
            f"{r['ceiling_sim_per_wall']:.0f}x at {RATE:.0f} req/s with no scheduling at all "
            f"(360x leaves {1e6 / (360 * RATE):.0f} us per request)"
        )
    out["radix_ops_per_s"] = radix_ops()
    out["block_pool_ops_per_s"] = block_pool_ops()
    print(f"radix tree: {out['radix_ops_per_s']:,.0f} ops/s; block pool: {out['block_pool_ops_per_s']:,.0f} ops/s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
