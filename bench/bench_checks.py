"""The checklist over a fleet: 1,000 instances x 1 h of samples at a 5 s interval (goal < 1 s).

Samples are real adapter output: each engine state is rendered by the reference pool's
emitter and read back through the adapters (SGLang and vLLM, four load shapes each); the
1,000 instances cycle over those eight one-hour series. Timed: building each instance's
Window and running every check, the verdict, findings and remedies ("cold"), and the same
with each Window already cut to the check span and its columns built, as an exporter that
keeps per-instance windows would ("warm").
Both with the checks looking at the whole hour and at the default 5-minute window.

Usage: .venv/bin/python bench/bench_checks.py [--instances 1000] [--hours 1] [--interval 5]
Last line: JSON with the figures (seconds for all instances; best of 3 runs).
"""

from __future__ import annotations

import argparse
import json
import time

from kvdiag.checks import diagnose
from kvdiag.checks.base import recent
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Scrape
from kvdiag.refpool.emit import EngineState, render
from kvdiag.window import Window

#: (usage, waiting per step, evictions per step, TTFT s) per load shape.
SHAPES = {
    "bottleneck": (0.97, 0.2, 1, 20.0),
    "near_capacity": (0.97, 0.0, 0, 1.0),
    "queue_only": (0.5, 0.2, 0, 4.0),
    "healthy": (0.4, 0.0, 0, 0.5),
}


def series(engine: str, shape: str, steps: int, interval: float) -> list[PoolSample]:
    usage, queue_growth, evictions, ttft = SHAPES[shape]
    state = EngineState(capacity_tokens=200_000)
    out = []
    for i in range(steps):
        state.used_tokens = int(usage * 200_000)
        state.evictable_tokens = 10_000
        state.running, state.waiting = 48, int(queue_growth * i)
        state.evictions_total += evictions
        for _ in range(10):
            state.ttft.observe(ttft)
        state.requests_total += 10
        state.prompt_tokens_total += 30_000
        state.generation_tokens_total += 5_000
        state.prefix_hit_tokens_total += 24_000
        out += normalize_scrape(Scrape(1.8e9 + i * interval, f"http://{engine}-{shape}:8000", None, render(engine, [state])))
    return out


def best(fn, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=5.0)
    args = ap.parse_args()
    steps = int(args.hours * 3600 / args.interval)
    t0 = time.perf_counter()
    templates = [series(e, s, steps, args.interval) for e in ("sglang", "vllm") for s in SHAPES]
    print(f"built {len(templates)} series of {steps} samples through the adapters in {time.perf_counter() - t0:.1f}s")
    pick = [templates[i % len(templates)] for i in range(args.instances)]
    result: dict[str, float | int] = {"instances": args.instances, "samples_per_instance": steps, "interval_s": args.interval}
    for label, config in (("window_1h", Config(window=args.hours * 3600)), ("window_5m", Config())):
        cold_s = best(lambda: [diagnose(Window(f"i{i}", samples), config) for i, samples in enumerate(pick)])
        warm_windows = [recent(Window(f"i{i}", samples), config) for i, samples in enumerate(pick)]
        verdicts: dict[str, int] = {}
        for w in warm_windows:  # builds and caches the columns
            name = diagnose(w, config).verdict.name
            verdicts[name] = verdicts.get(name, 0) + 1
        warm_s = best(lambda: [diagnose(w, config) for w in warm_windows])
        print(f"{label}: {cold_s:.3f}s cold ({cold_s / args.instances * 1e3:.2f} ms/instance), {warm_s:.3f}s with columns built; verdicts {verdicts}")
        result[f"{label}_cold_s"] = round(cold_s, 3)
        result[f"{label}_warm_s"] = round(warm_s, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
