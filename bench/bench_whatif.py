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
on the same fitted window, and the ratio is printed. ``--baseline-rev REV`` times them beside the tree
at git revision REV (its own bench script on the same window, compiled by its own build script
where it has one, else pure), the code a change replaces: this head's replays, then REV's, in
the same minutes, ``--reps`` times, and the median of the pairs' ratios.

The incident's windows can be kept (``--incident FILE``: read when it exists, written when not),
so a rerun against changed replay code skips the full-size hour; delete the file when the
reference engine changes what it emits. ``--recording FILE`` keeps the incident as a recording
(what ``kvdiag record`` writes: read when it exists, written by the simulation when not), and
``--command`` times what a user runs on it, ``kvdiag whatif --replay FILE`` in a process of its
own, end to end: reading and fitting the window, the six replays and the scale model's check
(the calibration's first 5 minutes at full size and as the model), the report.

Usage: .venv/bin/python bench/bench_whatif.py [--minutes 60] [--scale K|auto] [--baseline-minutes 5] [--jobs 2] [--engine sglang|vllm] [--incident FILE] [--recording FILE] [--command] [--window-only] [--baseline-rev REV [--reps N]]
Last line: JSON with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from builds import at_revision, in_pure_build, this_build
from kvdiag.checks import diagnose
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.refpool.scenarios import Deployment, Scenario, ScenarioRun
from kvdiag.refpool.sim import tune_gc
from kvdiag.refpool.workload import LogNormal, Poisson, SharedPrefix, Workload
from kvdiag.sources.recording import read_recording, write_recording
from kvdiag.whatif.compare import errors
from kvdiag.whatif.fit import fit
from kvdiag.whatif.levers import recommended_limit, resolve
from kvdiag.whatif.replay import Job, Run, emitted, replay_all
from kvdiag.whatif.scale import auto_scale, median_running
from kvdiag.window import Window, windows

DEPLOYMENT = Deployment("llama-3-8b", "h200", tp=2, mem_fraction=0.73, served_model="meta-llama/Meta-Llama-3-8B-Instruct")
INTERVAL = 15.0


def incident(minutes: float) -> Scenario:
    load = Workload(Poisson(50.0), LogNormal(1000, 0.5, hi=8000), LogNormal(800, 0.5, hi=4000), prefix=SharedPrefix(8, 0.5), seed=1)
    return Scenario("bench", "an hour at 50 req/s", ("unknown",), (load,), duration=minutes * 60, deployment=DEPLOYMENT)


def replays(jobs: list[Job], workers: int) -> tuple[list[Run], float]:
    t0 = time.perf_counter()
    runs = replay_all(jobs, workers, lambda r: print(f"  {r.label}: {r.wall_s:.0f}s {r.error}", flush=True))
    return runs, time.perf_counter() - t0


def incident_window(minutes: float, engine: str, keep: Path | None, recording: Path | None = None) -> tuple[Window, float]:
    """The incident's window, from ``keep`` when it holds this one, else from ``recording`` when
    it exists (read back as ``kvdiag whatif --replay`` reads it), else simulated (and written
    to ``recording`` first when one is asked for); kept in ``keep``. The seconds the simulation
    took (0 when read)."""
    key = (minutes, engine)
    if keep is not None and keep.exists() and (recording is None or recording.exists()):
        kept = pickle.loads(keep.read_bytes())
        if kept["key"] == key:
            return kept["window"], 0.0
    t0, simulated = time.perf_counter(), 0.0
    if recording is None:
        [window], _ = emitted(incident(minutes), engine, INTERVAL)
        simulated = time.perf_counter() - t0
    else:
        if not recording.exists():
            write_recording(recording, (scrape for _, scrape in ScenarioRun(incident(minutes), engine, record_steps=False).scrapes(INTERVAL)))
            simulated = time.perf_counter() - t0
        [window] = windows(s for scrape in read_recording(recording) for s in normalize_scrape(scrape, engine)).values()
        if len(window) != round(minutes * 60 / INTERVAL):
            raise SystemExit(f"{recording} holds {len(window)} scrapes, not {minutes:g} minutes' at {INTERVAL:g} s: another incident's")
    if keep is not None:
        keep.write_bytes(pickle.dumps({"key": key, "window": window}))
    return window, simulated


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


def command(recording: Path, workers: int) -> dict[str, object]:
    """``kvdiag whatif --replay recording`` run as a user runs it, in a process of its own (this
    build), timed from start to exit: its replays' own times from its progress lines, the scale
    it picked and the fit's quality from its JSON."""
    argv = [sys.executable, "-m", "kvdiag", "whatif", "--replay", str(recording), "--jobs", str(workers), "--json"]
    print(f"kvdiag whatif --replay {recording.name} --jobs {workers}, end to end:", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"kvdiag whatif exited {done.returncode}: {done.stderr.strip()}")
    replays = []
    for line in done.stderr.splitlines():
        m = re.match(r"whatif \[\d+/\d+\] .+?: (.+) (\d+)s$", line)
        if m:
            replays.append({"run": m[1], "wall_s": int(m[2])})
            print(f"  {m[1]}: {m[2]}s", flush=True)
    [inst] = json.loads(done.stdout)["instances"]
    print(f"  wall {wall:.0f}s from start to exit ({'within' if wall <= 60 else 'over'} the 60 s goal); "
          f"{inst['fit_quality']}; {inst['scale_model']}", flush=True)  # fmt: skip
    return {"wall_s": round(wall, 1), "replays": replays, "fit_quality": inst["fit_quality"], "scale_model": inst["scale_model"]}


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
    p.add_argument("--recording", type=Path, metavar="FILE",
                   help="keep the incident as a recording (kvdiag record's format): read when it exists, written when not")  # fmt: skip
    p.add_argument("--command", action="store_true",
                   help="also time `kvdiag whatif --replay` on the recording end to end (a temporary one without --recording)")  # fmt: skip
    p.add_argument("--window-only", action="store_true", help="the window's replays only (the pure build's side of a run)")
    p.add_argument("--baseline-rev", metavar="REV",
                   help="also time the window's replays as git revision REV runs them (built as REV builds itself), each "
                   "right after this head's")  # fmt: skip
    p.add_argument("--reps", type=int, default=1, help="with --baseline-rev: pairs of runs, this head's then REV's (default 1)")
    args = p.parse_args()
    tune_gc()
    config = Config()
    build = this_build()
    print(f"reference pool: {build}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        keep = args.incident or Path(tmp) / "incident.pkl"  # the pure side reads it
        recording = args.recording or (Path(tmp) / "incident.jsonl.gz" if args.command else None)
        print(json.dumps(run(args, config, build, keep, recording)))


def run(args: argparse.Namespace, config: Config, build: str, keep: Path, recording: Path | None) -> dict[str, object]:
    """The figures: the baseline, the window's replays, the command end to end and, compiled,
    the pure build's replays."""
    incident = incident_window(args.minutes, args.engine, keep, recording)
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
        "command": command(recording, args.jobs) if args.command and recording is not None and not args.window_only else None,
    }  # fmt: skip
    if build == "compiled" and not args.window_only:
        print("the same replays in the pure build:", flush=True)
        pure = in_pure_build(__file__, _window_argv(args, k, keep))["window"]
        wall, pure_wall = (w[f"wall_s_scale_{k:g}"] for w in (out["window"], pure))  # type: ignore[index]
        out["pure_window"] = pure
        out["compiled_speedup"] = round(pure_wall / wall, 2)
        print(f"  wall {pure_wall:.0f}s in the pure build: {out['compiled_speedup']:.2f}x compiled", flush=True)
    if args.baseline_rev and not args.window_only:
        out["baseline_rev"] = against_revision(args, k, keep, config)
    return out


def against_revision(args: argparse.Namespace, k: float, keep: Path, config: Config) -> dict[str, object]:
    """The window's replays in this build and at ``--baseline-rev`` (built as that revision
    builds itself), one right after the other, ``--reps`` times: the machine's speed drifts by a
    third from one half-hour to the next, so each pair is timed within the same minutes and the
    median of the pairs' ratios is the figure."""
    key, pairs = f"wall_s_scale_{k:g}", []
    with at_revision(args.baseline_rev) as at_rev:
        for i in range(args.reps):
            print(f"the window's replays, this head then {args.baseline_rev} ({i + 1}/{args.reps}):", flush=True)
            head = whatif(args.minutes, args.engine, (k,), args.jobs, config, keep)
            base = at_rev(__file__, _window_argv(args, k, keep))
            ratio = base["window"][key] / head[key]  # type: ignore[index,operator]
            pairs.append({"head_wall_s": head[key], "rev_wall_s": base["window"][key], "rev_build": base.get("build"), "speedup": round(ratio, 2)})  # type: ignore[index]
            print(f"  wall {base['window'][key]:.0f}s at {args.baseline_rev} ({base.get('build')}): this head is {ratio:.2f}x faster", flush=True)  # type: ignore[index]
    median = float(np.median([p["speedup"] for p in pairs]))
    print(f"  median over {len(pairs)} pairs: this head is {median:.2f}x faster than {args.baseline_rev}", flush=True)
    return {"rev": args.baseline_rev, "pairs": pairs, "median_speedup": round(median, 2)}


def _window_argv(args: argparse.Namespace, k: float, keep: Path) -> list[str]:
    """A child's arguments: the same window's replays only, at scale ``k``, read from ``keep``."""
    return ["--window-only", "--minutes", str(args.minutes), "--scale", str(k), "--engine", args.engine,
            "--jobs", str(args.jobs), "--incident", str(keep)]  # fmt: skip


if __name__ == "__main__":
    main()
