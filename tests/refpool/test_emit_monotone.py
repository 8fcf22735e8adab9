"""Emission never emits the impossible: in every scenario of the catalogue, on both reference
engines, every counter series (counters, and histograms' buckets, counts and sums) only grows
between two scrapes of the same engine process, and none is ever negative.

A counter computed as a difference of counters bumped over different spans (prompt tokens at
finish minus hits at admission) can dip; a real engine's counter cannot.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvdiag.refpool.scenarios import SCENARIOS, ScenarioRun

_TYPE = re.compile(r"^# TYPE (\S+) (counter|histogram)$", re.M)
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? (\S+)", re.M)
INTERVAL = 10.0


def counter_samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample of a counter or histogram family."""
    families = {m.group(1): m.group(2) for m in _TYPE.finditer(text)}
    out = {}
    for m in _SAMPLE.finditer(text):
        name = m.group(1)
        if name.endswith("_created"):
            continue
        for suffix in ("_total", "_bucket", "_count", "_sum", ""):
            base = name[: len(name) - len(suffix)] if suffix and name.endswith(suffix) else name
            if (suffix == "" or name.endswith(suffix)) and base in families:
                out[name + (m.group(2) or "")] = float(m.group(3))
                break
    return out


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_emitted_counter_only_grows(name: str, engine: str) -> None:
    scenario = SCENARIOS[name]
    run = ScenarioRun(replace(scenario, duration=min(scenario.duration, 180.0)), engine)
    restart = scenario.restart_at
    prev: dict[str, float] = {}
    prev_t = 0.0
    seen = 0
    for t, scrape in run.scrapes(INTERVAL):
        now = counter_samples(scrape.body)
        assert now, f"{name}/{engine}: no counter in the scrape at t={t}"
        restarted = restart is not None and prev_t < restart <= t
        for key, value in now.items():
            assert value >= 0, f"{name}/{engine} t={t}: {key} = {value} < 0"
            if key in prev and not restarted:
                assert value >= prev[key], f"{name}/{engine} t={t}: {key} fell from {prev[key]} to {value}"
        seen += len(now)
        prev, prev_t = now, t
    assert seen > 0
