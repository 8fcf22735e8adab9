"""The demo's one time base: the exporter's ring read on an engine's simulated clock, so
rates, trends and spans are per simulated second (the story), not per wall second."""

from __future__ import annotations

import numpy as np

from kvdiag.commands.demo import wall_config
from kvdiag.report.live import StoryClock
from kvdiag.config import Config
from kvdiag.model import PoolSample
from kvdiag.server.ring import Ring


def test_scrape_times_map_to_the_story_the_engine_served() -> None:
    clock = StoryClock(origin=1_000.0)
    for wall, story in ((10.0, 0.0), (11.0, 12.0), (12.0, 24.0), (13.0, 30.0)):  # the story lags at the end
        clock.mark(wall, story)
    clock.mark(12.5, 99.0)  # out of order: ignored, never a clock that runs backwards
    assert clock.story(np.array([10.0, 11.5, 13.0, 20.0])).tolist() == [1_000.0, 1_018.0, 1_030.0, 1_030.0]


def test_a_ring_window_on_the_story_clock_gives_rates_per_simulated_second() -> None:
    ring = Ring(16)
    for i in range(5):  # a scrape a wall second, two evictions each
        ring.append(PoolSample(instance="i", engine="e", ts=100.0 + i, evictions_total=2.0 * i))
    clock = StoryClock(origin=0.0)
    clock.mark(100.0, 0.0)
    clock.mark(104.0, 48.0)  # 12 simulated seconds per wall second
    wall, story = ring.window("i"), ring.window("i", clock=clock.story)
    assert wall is not None and story is not None
    assert wall.rate("evictions_total") == 2.0
    assert story.rate("evictions_total") == 2.0 / 12
    assert (story.start, story.end) == (0.0, 48.0)
    assert StoryClock(0.0).story(np.array([5.0])).tolist() == [5.0]  # no scrape served yet: as given


def test_the_exporter_reads_the_same_story_on_the_wall_clock() -> None:
    """Its page must give the terminal's verdicts: every look-back span divided by the speed;
    the TTFT SLO is the engine's own latency (story seconds already) and stays."""
    story = Config()
    wall = wall_config(story, 12.0)
    assert wall.window == story.window / 12
    assert wall.saturated_short_window == story.saturated_short_window / 12
    assert wall.queue_short_window == story.queue_short_window / 12
    assert wall.ttft_slo == story.ttft_slo and wall.saturated_usage == story.saturated_usage
