"""Reader speed against prometheus_client's parser, on both engine fixtures, in one run.

Usage: .venv/bin/python bench/bench_exposition.py [--fixtures DIR] [--repeat N]
Last line: JSON with ``speedup_vs_prometheus_client`` (steady state: the label cache warm,
as when an exporter scrapes the same targets every interval) and the cold-cache figure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvdiag.engines import READER

FIXTURES = ("sglang-0.5.23-midload.prom", "vllm-0.33.0-midload.prom")


def _best(fn, repeat: int) -> float:
    """Best of 5 runs of ``repeat`` calls, in seconds per call (least disturbed by other load)."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        runs.append((time.perf_counter() - start) / repeat)
    return min(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", default=str(Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
    ap.add_argument("--repeat", type=int, default=100)
    args = ap.parse_args()
    result: dict[str, float] = {}
    base_total = warm_total = cold_total = 0.0
    for name in FIXTURES:
        text = (Path(args.fixtures) / name).read_text()
        base = _best(lambda: list(text_string_to_metric_families(text)), max(1, args.repeat // 10))
        warm = _best(lambda: READER.read(text), args.repeat)

        def cold() -> None:
            READER._labels.clear()
            READER.read(text)

        cold_t = _best(cold, args.repeat)
        base_total, warm_total, cold_total = base_total + base, warm_total + warm, cold_total + cold_t
        print(f"{name}: prometheus_client {base * 1e3:.3f} ms, kvdiag {warm * 1e3:.3f} ms warm / {cold_t * 1e3:.3f} ms cold, speedup {base / warm:.1f}x / {base / cold_t:.1f}x")
        result[f"{name}_speedup"] = round(base / warm, 1)
    result["speedup_cold_cache"] = round(base_total / cold_total, 1)
    result["speedup_vs_prometheus_client"] = round(base_total / warm_total, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
