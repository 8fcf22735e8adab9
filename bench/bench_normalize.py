"""Normalization cost per instance as one server holds more data-parallel instances, in one run.

Usage: .venv/bin/python bench/bench_normalize.py [--sizes 1,16,64,256] [--repeat N]

The baseline is the same engine's one-instance exposition: a linear reader keeps the cost per
instance flat, so ``per_instance_ratio`` (cost per instance at N over cost per instance at 1)
stays near 1 at every N. Before the adapters grouped samples per family, a DP-256 vLLM server
took 9.1 s (quadratic in instances); the last line is JSON with each engine's figures.
"""

from __future__ import annotations

import argparse
import json

from bench_checks import best  # best of N calls, in seconds (bench/ is on sys.path when run)
from kvdiag.engines import normalize_scrape
from kvdiag.model import Scrape
from kvdiag.refpool.emit import EngineState, render


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1,16,64,256")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    result: dict[str, dict[str, float]] = {}
    for engine in ("sglang", "vllm"):
        base = None
        for n in sizes:
            states = [EngineState(capacity_tokens=100_000, running=3, waiting=1) for _ in range(n)]
            scrape = Scrape(ts=0.0, target="http://127.0.0.1:1", content_type="text/plain", body=render(engine, states, openmetrics=False))
            got = normalize_scrape(scrape)
            assert len(got) == n, (engine, n, len(got))
            seconds = best(lambda: normalize_scrape(scrape), args.repeat)
            per = seconds / n
            base = per if base is None else base
            result[f"{engine}_{n}"] = {"seconds": round(seconds, 5), "per_instance_ratio": round(per / base, 2)}
            print(f"{engine:6} {n:4} instances: {seconds * 1e3:8.1f} ms, {per * 1e6:7.0f} us per instance ({per / base:.2f}x the 1-instance cost)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
