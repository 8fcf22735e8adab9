"""Reader speed against prometheus_client's parser, on both engine fixtures, in one run.

Usage: .venv/bin/python bench/bench_exposition.py [--fixtures DIR] [--repeat N] [--baseline REV]
Last line: JSON with ``speedup_vs_prometheus_client`` (steady state: the label cache warm,
as when an exporter scrapes the same targets every interval) and the cold-cache figure.
``--baseline REV`` also times the reader as it was at git revision REV (its
``kvdiag/exposition.py`` loaded beside the current one) in the same run:
``ratio_vs_baseline`` > 1 means the current reader is slower.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvdiag.engines import READER

FIXTURES = ("sglang-0.5.23-midload.prom", "vllm-0.33.0-midload.prom")


def _best(fn, repeat: int) -> float:
    """Best of 5 runs of ``repeat`` calls, in seconds per call (least disturbed by other load)."""
    return _best_of(fn, repeat=repeat)[0]


def _best_of(*fns, repeat: int, rounds: int = 5) -> list[float]:  # noqa: ANN002
    """Best per-call seconds of each function over ``rounds`` rounds that run them in turn,
    so that a change in the machine's load hits every contender alike."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / repeat)
    return best


def _baseline_reader(rev: str):  # noqa: ANN202 (the Reader class of another revision)
    """The Reader of ``kvdiag/exposition.py`` at git revision ``rev``, for the same families."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:kvdiag/exposition.py"], cwd=root, capture_output=True, text=True, check=True).stdout
    mod = sys.modules[f"exposition_at_{rev}"] = types.ModuleType(f"exposition_at_{rev}")  # dataclasses look it up
    exec(compile(src, f"{rev}:kvdiag/exposition.py", "exec"), mod.__dict__)  # noqa: S102 (our own file at another revision)
    return mod.Reader(READER.wanted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", default=str(Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--baseline", metavar="REV", help="also time the reader of this git revision")
    args = ap.parse_args()
    result: dict[str, float] = {}
    base_total = warm_total = cold_total = cur_total = old_total = 0.0
    old = _baseline_reader(args.baseline) if args.baseline else None
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
        if old is not None:
            old.read(text)  # warm its label cache too
            cur_t, old_t = _best_of(lambda: READER.read(text), lambda: old.read(text), repeat=args.repeat, rounds=9)
            cur_total, old_total = cur_total + cur_t, old_total + old_t
            print(f"{name}: kvdiag {cur_t * 1e3:.3f} ms, at {args.baseline} {old_t * 1e3:.3f} ms (warm, interleaved), current/baseline {cur_t / old_t:.2f}")
    result["speedup_cold_cache"] = round(base_total / cold_total, 1)
    result["speedup_vs_prometheus_client"] = round(base_total / warm_total, 1)
    if old is not None:
        result["ratio_vs_baseline"] = round(cur_total / old_total, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
