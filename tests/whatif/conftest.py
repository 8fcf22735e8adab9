"""Shared setups of the what-if tests: scenarios cut short, run once per session on the reference
engines, and their emitted metrics as windows and as recordings."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from kvdiag.refpool.scenarios import SCENARIOS, ScenarioRun
from kvdiag.sources.recording import write_recording
from kvdiag.whatif.replay import emitted
from kvdiag.window import Window


@lru_cache(maxsize=None)
def story(name: str, engine: str, duration: float) -> tuple[Window, ScenarioRun]:
    """The scenario cut to ``duration`` on ``engine``: its one instance's window and the run."""
    windows, run = emitted(replace(SCENARIOS[name], duration=duration), engine, 5.0)
    return windows[0], run


def record(name: str, engine: str, duration: float, path: Path) -> Path:
    """The scenario cut to ``duration`` on ``engine``, written as a recording (as `kvdiag record` would)."""
    run = ScenarioRun(replace(SCENARIOS[name], duration=duration), engine)
    write_recording(path, (scrape for _, scrape in run.scrapes(5.0)))
    return path
