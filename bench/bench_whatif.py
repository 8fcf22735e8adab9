"""`kvdiag whatif` on a one-hour window: calibration plus five remedies, wall time, full size and
a scale model, in one run.

The incident: an hour of the reference pool's benchmark load (bench_refpool.py: 50 req/s of
chat, 1k-token prompts half shared with one of 8 system prompts, ~800-token answers) on a
1.5 M-token pool (Llama-3-8B, 2 x H200, memory fraction 0.73), scraped every 15 s and read
back through the adapters as a recording would be. Then, as `kvdiag whatif` does: the fit, the
default remedies (FP8 KV, TP x2, one more DP replica, the recommended admission limit, a higher
memory fraction) and the calibration, replayed in ``--jobs`` worker processes as a scale model
(``--scale``, by default the one ``--scale auto`` picks: 1/10 on SGLang, 1/8 on vLLM), timed wall-clock (the goal: 60 s). The baseline, in the same run: a
``--baseline-minutes`` window of the same load replayed at full size and as the scale model,
timed both ways, with each replay's scale-model error against full size (P99 TTFT from both
sides' simulated requests, as the what-if pairs compare). An hour at full size is not run: at
the pool's speed here it takes about an hour; the baseline's simulated seconds per wall second
say how long.

With the compiled build in use (kvdiag/refpool/native.py), the window's replays are timed
again in the pure build (the same sources, not compiled) in a child process of the same run,
on the same fitted window, and the ratio is printed. ``--baseline-rev REV`` times them once more
as the tree at git revision REV replays them (its own bench script, pure, on the same window),
the code a change replaces, in the same run.

The incident's windows can be kept (``--incident FILE``: read when it exists, written when not),
so a rerun against changed replay code skips the full-size hour; delete the file when the
reference engine changes what it emits.

Usage: .venv/bin/python bench/bench_whatif.py [--minutes 60] [--scale K|auto] [--baseline-minutes 5] [--jobs 2] [--engine sglang|vllm] [--incident FILE] [--window-only] [--baseline-rev REV]
Last line: JSON with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import tempfile
import time
from pathlib import Path

from builds import at_revision, in_pure_build, this_build
from kvdiag.checks import diagnose
from kvdiag.config import Config
from kvdiag.refpool.scenarios import Deployment, Scenario
from kvdiag.refpool.sim import tune_gc
from kvdiag.refpool.workload import LogNormal, Poisson, SharedPrefix, Workload
from kvdiag.whatif.compare import errors
from kvdiag.whatif.fit import fit
from kvdiag.whatif.levers import recommended_limit, resolve
from kvdiag.whatif.replay import Job, Run, emitted, replay_all
from kvdiag.whatif.scale import auto_scale, median_running
from kvdiag.window import Window

DEPLOYMENT = Deployment("llama-3-8b", "h200", tp=2, mem_fraction=0.73, served_model="meta-llama/Meta-Llama-3-8B-Instruct")
INTERVAL = 15.0


def incident(minutes: float) -> Scenario:
    load = Workload(Poisson(50.0), LogNormal(1000, 0.5, hi=8000), LogNormal(800, 0.5, hi=4000), prefix=SharedPrefix(8, 0.5), seed=1)
    return Scenario("bench", "an hour at 50 req/s", ("unknown",), (load,), duration=minutes * 60, deployment=DEPLOYMENT)


def replays(jobs: list[Job], workers: int) -> tuple[list[Run], float]:
    t0 = time.perf_counter()
    runs = replay_all(jobs, workers, lambda r: print(f"  {r.label}: {r.wall_s:.0f}s {r.error}", flush=True))
    return runs, time.perf_counter() - t0


def incident_window(minutes: float, engine: str, keep: Path | None) -> tuple[Window, float]:
    """The incident's window, from ``keep`` when it holds this one, else simulated (and kept
    there); the seconds the simulation took (0 when read)."""
    key = (minutes, engine)
    if keep is not None and keep.exists():
        kept = pickle.loads(keep.read_bytes())
        if kept["key"] == key:
            return kept["window"], 0.0
    t0 = time.perf_counter()
    [window], _ = emitted(incident(minutes), engine, INTERVAL)
    if keep is not None:
        keep.write_bytes(pickle.dumps({"key": key, "window": window}))
    return window, time.perf_counter() - t0


def auto(window: Window) -> float:
    """The scale ``kvdiag whatif --scale auto`` picks for ``window`` (its fitted arrivals and its
    median running count)."""
    return auto_scale(fit(window).arrivals.total, median_running(window))


def whatif(
    minutes: float, engine: str, scales: tuple[float, ...], workers: int, config: Config, keep: Path | None = None,
    incident: tuple[Window, float] | None = None,
) -> dict[str, object]:  # fmt: skip
    """The incident of ``minutes`` (``incident``: its window, already read, and the seconds its
    simulation took), fitted, and its calibration + default remedies replayed at each of
    ``scales`` (timed); the scale models' errors against the full-size replays when 1 is among
    them."""
    window, t_incident = incident or incident_window(minutes, engine, keep)
    how = f"simulated in {t_incident:.0f}s" if t_incident else f"read from {keep}"
    print(f"incident: {minutes:g} min on {engine}, {len(window)} scrapes, {how}", flush=True)
    f = fit(window)
    levers = resolve([], f.deployment, recommended_limit(diagnose(window, config).figures))
    scenario = f.scenario()
    out: dict[str, object] = {"minutes": minutes, "pool_tokens": f.pool_tokens, "rate": round(f.rate, 2),
                              "incident_s": round(t_incident, 1), "remedies": [lv.label for lv in levers]}  # fmt: skip
    results: dict[float, list[Run]] = {}
    for k in scales:
        jobs = [Job("bench", None, scenario, f.engine, f.interval, config, k)]
        jobs += [Job("bench", lv, lv.apply(scenario), f.engine, f.interval, config, k) for lv in levers]
        print(f"calibration + {len(levers)} remedies at 1/{k:g} scale:", flush=True)
        results[k], wall = replays(jobs, workers)
        out[f"wall_s_scale_{k:g}"] = round(wall, 1)
        out[f"sim_s_per_wall_s_per_run_scale_{k:g}"] = round(len(jobs) * (minutes * 60 + f.interval) / sum(r.wall_s for r in results[k]), 1)
        print(f"  wall {wall:.0f}s for {len(jobs)} replays ({'within' if wall <= 60 else 'over'} the 60 s goal)", flush=True)
    if 1.0 in results:
        rows = []
        for k in (s for s in scales if s != 1.0):
            for full, model in zip(results[1.0], results[k]):
                if full.outcome is None or model.outcome is None:
                    rows.append({"scale": k, "run": full.label, "error": full.error or model.error})
                    continue
                e = errors(full.outcome, model.outcome, exact=True)
                rows.append({"scale": k, "run": full.label, "p99_full_s": full.outcome.p99_ttft_sim,
                             "p99_scaled_s": model.outcome.p99_ttft_sim, "verdict_full": full.outcome.verdict,
                             "verdict_scaled": model.outcome.verdict, "errors": e.describe(), "within_goal": e.good})  # fmt: skip
                print(f"  {full.label}: 1/{k:g} scale model vs full size: {e.describe()}", flush=True)
            out[f"speedup_scale_{k:g}_vs_full"] = round(float(out["wall_s_scale_1"]) / float(out[f"wall_s_scale_{k:g}"]), 2)  # type: ignore[arg-type]
        out["scale_model_errors"] = rows
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=60.0, help="the window replayed as a scale model (default 60)")
    p.add_argument("--scale", default="auto", help="the scale model's k (default: what `kvdiag whatif --scale auto` picks for the hour)")
    p.add_argument("--baseline-minutes", type=float, default=5.0,
                   help="the window replayed at full size and as the scale model, for the model's error (default 5; "
                   "an hour at full size takes about an hour here; 0: none)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="worker processes (default: one per core)")
    p.add_argument("--engine", default="sglang", choices=("sglang", "vllm"))
    p.add_argument("--incident", type=Path, metavar="FILE",
                   help="keep the one-hour incident's window here: read when it exists, written when not")  # fmt: skip
    p.add_argument("--window-only", action="store_true", help="the window's replays only (the pure build's side of a run)")
    p.add_argument("--baseline-rev", metavar="REV", help="also time the window's replays as git revision REV runs them (pure)")
    args = p.parse_args()
    tune_gc()
    config = Config()
    build = this_build()
    print(f"reference pool: {build}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        keep = args.incident or Path(tmp) / "incident.pkl"  # the pure side reads it
        print(json.dumps(run(args, config, build, keep)))


def run(args: argparse.Namespace, config: Config, build: str, keep: Path) -> dict[str, object]:
    """The figures: the baseline, the window's replays and, compiled, the pure build's."""
    incident = incident_window(args.minutes, args.engine, keep)
    k = auto(incident[0]) if args.scale == "auto" else float(args.scale)
    print(f"scale model: 1/{k:g}" + (" (--scale auto)" if args.scale == "auto" else ""), flush=True)
    out = {
        "engine": args.engine,
        "jobs": args.jobs,
        "build": build,
        "scale": k,
        "baseline": None if args.window_only or args.baseline_minutes <= 0 else
        whatif(args.baseline_minutes, args.engine, (k, 1.0), args.jobs, config),
        "window": whatif(args.minutes, args.engine, (k,), args.jobs, config, keep, incident),
    }  # fmt: skip
    if build == "compiled" and not args.window_only:
        print("the same replays in the pure build:", flush=True)
        pure = in_pure_build(__file__, _window_argv(args, k, keep))["window"]
        wall, pure_wall = (w[f"wall_s_scale_{k:g}"] for w in (out["window"], pure))  # type: ignore[index]
        out["pure_window"] = pure
        out["compiled_speedup"] = round(pure_wall / wall, 2)
        print(f"  wall {pure_wall:.0f}s in the pure build: {out['compiled_speedup']:.2f}x compiled", flush=True)
    if args.baseline_rev and not args.window_only:
        print(f"the same replays at {args.baseline_rev} (pure):", flush=True)
        base = at_revision(args.baseline_rev, __file__, _window_argv(args, k, keep))["window"]
        key = f"wall_s_scale_{k:g}"
        out["baseline_rev"] = {"rev": args.baseline_rev, "window": base}
        for name, w in ((build, out["window"]), ("pure", out.get("pure_window"))):
            if w is not None:
                ratio = base[key] / w[key]  # type: ignore[index,operator]
                out["baseline_rev"][f"speedup_{name}"] = round(ratio, 2)  # type: ignore[index]
                print(f"  wall {base[key]:.0f}s at {args.baseline_rev}: this head {name} is {ratio:.2f}x faster", flush=True)  # type: ignore[index]
    return out


def _window_argv(args: argparse.Namespace, k: float, keep: Path) -> list[str]:
    """A child's arguments: the same window's replays only, at scale ``k``, read from ``keep``."""
    return ["--window-only", "--minutes", str(args.minutes), "--scale", str(k), "--engine", args.engine,
            "--jobs", str(args.jobs), "--incident", str(keep)]  # fmt: skip


if __name__ == "__main__":
    main()
