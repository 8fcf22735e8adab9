"""``kvdiag demo --real``: the demo's story on real engines, for someone without a GPU.

A real vLLM and a real SGLang server start on this machine's CPU with the tiny model (random
weights, a 2,048-token KV pool each) and get the same shared-prefix load: light for 30 s, then
more than the pool can serve. kvdiag's exporter scrapes both, and the terminal shows the pool and
the verdict as ``kvdiag demo`` does, on the wall clock (nothing is sped up). It says first what it
installs (the engines' environments, built once per machine by scripts/real-env.sh).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from kvdiag.report.live import STORY as CHECKS
from kvdiag.report.live import Exporter, StoryClock, deadline, watch
from kvdiag.real import envs
from kvdiag.real.catalogue import CI_STORY, STORIES
from kvdiag.real.engines import Engine
from kvdiag.real.load import Driver, Overload
from kvdiag.real.truth import Tail
from kvdiag.report.diagnosis import render as render_diagnoses

DURATION_S = 240.0
INTERVAL_S = 5.0


def run_real(args: argparse.Namespace, console: Console) -> int:
    duration = DURATION_S if args.duration is None else args.duration
    interval = INTERVAL_S if args.interval == 1.0 else args.interval
    story = STORIES[CI_STORY]
    console.print("kvdiag demo --real: real vLLM and SGLang servers on this machine's CPU, a tiny model with random weights.")
    for engine in envs.ENGINES:
        built = (envs.location(engine) / ".stamp").exists()
        console.print(f"  {engine}: {envs.SIZES[engine]}, in {envs.location(engine)}" + (" (built)" if built else " (to build now)"),
                      highlight=False, soft_wrap=True)  # fmt: skip
    console.print("  each server takes 1-4 minutes to start (more on a busy machine); both run at once, with the load, on every core", highlight=False)
    for engine in envs.ENGINES:
        envs.build(engine)
    assert isinstance(story.load, Overload)
    load = replace(story.load, hold=duration, longest=duration, drain=0.0)  # the overload until the demo ends
    with tempfile.TemporaryDirectory(prefix="kvdiag-demo-") as tmp:
        engines: list[Engine] = []
        drivers: list[Driver] = []
        exporter = None
        try:
            for engine in envs.ENGINES:
                console.print(f"starting {engine} ...", highlight=False)
                engines.append(Engine(story.spec(engine), Path(tmp) / engine).start())
                console.print(f"{engine} {engines[-1].url} (started in {engines[-1].started_s:.0f} s)", highlight=False)
            clocks = {e.url + "/metrics": StoryClock(time.time()) for e in engines}
            exporter = Exporter(list(clocks), interval, CHECKS)
            console.print(f"exporter: {exporter.url}/ (page), {exporter.url}/api/v1/verdicts (API), {exporter.url}/metrics",
                          highlight=False, soft_wrap=True)  # fmt: skip
            for e in engines:
                driver = Driver(e.url, story.shape)
                threading.Thread(target=driver.run, args=(load, Tail(e.truth_path).limited), daemon=True).start()
                drivers.append(driver)
            header = "t={t:.0f}s on real engines (wall clock); checks over the last " f"{CHECKS.window:g}s; rates per minute"
            rows = watch(console, exporter, clocks, deadline(duration), interval, not args.no_live, header)
        finally:
            for d in drivers:
                d.stop()
            if exporter is not None:
                exporter.stop()
            for e in engines:
                e.stop()
    render_diagnoses(console, [r.diagnosis for r in rows])
    return 0
