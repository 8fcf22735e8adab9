"""The scrape loop under bad targets: a hung, slow, failing, huge, restarting or non-engine
target never delays or corrupts the others, and each says what is wrong with it."""

from __future__ import annotations

import itertools
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Callable

import numpy as np

from kvdiag.refpool.emit import content_type, render
from kvdiag.refpool.scripted import SaturationStory
from kvdiag.server.loop import ScrapeLoop, phase
from kvdiag.server.settings import Settings
from tests.server.conftest import HANG_GUARD_S, Handle, reply, settings_for, story_engine, wait_for

FIFTY_MB = 50 * 1024 * 1024


#: The scrape deadline of every target here. Long, so that a loaded machine never pushes the good
#: target's own scrape past it, and so that a bad target holding a worker until it, if it delayed
#: the good one, would open a gap far wider than any a busy machine makes (asserted below).
DEADLINE_S = 6.0
INTERVAL_S = 0.5


def test_bad_targets_never_delay_or_corrupt_a_good_one(raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    release = threading.Event()
    chunk = b"# padding\n" * 6554  # ~64 KB

    def hang(h: BaseHTTPRequestHandler) -> None:
        release.wait(HANG_GUARD_S)

    def slow(h: BaseHTTPRequestHandler) -> None:  # answers, but after the deadline
        release.wait(HANG_GUARD_S)
        reply(h, 200, b"")

    def flood(h: BaseHTTPRequestHandler) -> None:  # 50 MB, no Content-Length: the cap stops it
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.end_headers()
        for _ in range(FIFTY_MB // len(chunk)):
            h.wfile.write(chunk)

    def declared(h: BaseHTTPRequestHandler) -> None:  # announces 50 MB: refused before reading
        h.send_response(200)
        h.send_header("Content-Length", str(FIFTY_MB))
        h.end_headers()
        h.wfile.write(chunk)

    good = story_engine("sglang")
    urls = {
        "good": good.url,
        "hang": raw_server(hang),
        "slow": raw_server(slow),
        "error": raw_server(lambda h: reply(h, 500, b"boom")),
        "flood": raw_server(flood),
        "declared": raw_server(declared),
        "not_engine": raw_server(lambda h: reply(h, 200, b"# TYPE node_load1 gauge\nnode_load1 0.5\n")),
    }
    try:
        # The deadline outlasts the interval: the hung and slow targets hold a worker each for
        # many of the good target's intervals (their next scrapes are skipped, not queued).
        loop = start_loop(settings_for(list(urls.values()), interval=INTERVAL_S, timeout=DEADLINE_S))
        state = {name: loop.targets[url] for name, url in urls.items()}
        assert wait_for(lambda: all(s.last_scrape is not None for s in state.values()) and len(_good_instance(state["good"]).ring) >= 7)
        expectations = {
            "hang": "timed out",
            "slow": "timed out",
            "error": "HTTP 500",
            "flood": "exceeds the",
            "declared": "exceeds the",
            "not_engine": "unknown engine",
        }
        for name, words in expectations.items():
            assert not state[name].up and words in (state[name].error or ""), (name, state[name].error)
            assert state[name].failure is not None and state[name].failure.verdict.name == "unknown"
        assert state["good"].up
        ts, usage = _good_instance(state["good"]).ring.column("usage_ratio")
        assert ts[-1] - ts[0] >= DEADLINE_S - 2 * INTERVAL_S  # the good samples span the bad targets' hold
        gaps = np.diff(ts)
        # Waiting on a bad target would leave a gap of the whole deadline; a busy machine's
        # late scrape leaves a few intervals at most.
        assert gaps.max() < DEADLINE_S / 2, gaps
        assert not np.isnan(usage).any()
    finally:
        release.set()
        good.stop()


def _good_instance(state):  # type: ignore[no-untyped-def]
    return next(iter(state.instances.values()))


def test_a_restarting_engine_is_a_counter_reset_not_a_spike(raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    story, served = SaturationStory(), itertools.count()
    restart_after = 4  # scrapes served (12 simulated seconds each), not wall time: a busy machine scrapes later, not less

    def engine(h: BaseHTTPRequestHandler) -> None:
        n = next(served)
        t = 100 + n * 12 if n < restart_after else 61 + (n - restart_after) * 12  # restarted: counters near 0
        body = render("vllm", [story.state(t)], openmetrics=False)
        reply(h, 200, body.encode(), content_type(False))

    url = raw_server(engine)
    loop = start_loop(settings_for([url], interval=0.3, window=60))
    state = loop.targets[url]
    exported: list[float] = []

    def restarted() -> bool:  # two scrapes after the restart, however long a busy machine takes to get there
        inst = next(iter(state.instances.values()), None)
        if inst is None or inst.evictions_total is None:
            return False
        exported.append(inst.evictions_total)
        _, raw = inst.ring.column("evictions_total")
        drops = np.flatnonzero(np.diff(raw) < 0)
        return len(drops) > 0 and len(raw) - drops[0] > 2

    assert wait_for(restarted)
    inst = next(iter(state.instances.values()))
    _, raw = inst.ring.column("evictions_total")
    assert (np.diff(raw) < 0).sum() == 1  # the engine's counter dropped once
    assert all(b >= a for a, b in zip(exported, exported[1:]))  # kvdiag's never does
    increase = inst.window(loop.settings.checks).increase("evictions_total")
    assert increase == inst.evictions_total - raw[0]  # the same reset-safe arithmetic as the window


def test_targets_come_and_go_and_keep_their_phase(start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    a, b = story_engine("sglang"), story_engine("vllm")
    try:
        loop = start_loop(settings_for([a.url], interval=0.3))
        assert wait_for(lambda: loop.ready)
        loop.set_targets(loop.settings.targets + (type(loop.settings.targets[0])(b.url),))
        assert wait_for(lambda: loop.targets[b.url].up)
        loop.set_targets(loop.settings.targets)
        assert b.url not in loop.targets and loop.targets[a.url].up
        assert 0 <= phase(a.url) < 1 and phase(a.url) == phase(a.url)
        added_again = loop.settings.targets + (type(loop.settings.targets[0])(b.url),)
        loop.set_targets(added_again)
        assert wait_for(lambda: loop.targets[b.url].up)
        time.sleep(1.5)
        count = sum(len(i.ring) for i in loop.targets[b.url].instances.values())
        assert count <= 1.5 / 0.3 + 2, count  # one schedule per target, not one per time it was added
    finally:
        a.stop()
        b.stop()


def test_file_sd_targets_join_and_leave_the_loop(tmp_path, start_loop: Callable[[Settings], ScrapeLoop]) -> None:  # type: ignore[no-untyped-def]
    import json
    import os
    from dataclasses import replace

    engine = story_engine("vllm")
    try:
        sd = tmp_path / "engines.json"
        sd.write_text(json.dumps([{"targets": [engine.url], "labels": {"cluster": "east"}}]))
        loop = start_loop(replace(settings_for([]), file_sd=(sd,)))
        assert wait_for(lambda: engine.url in loop.targets and loop.targets[engine.url].up)
        assert loop.targets[engine.url].target.label_dict == {"cluster": "east"}
        sd.write_text("[]")
        os.utime(sd, ns=(1, 10**18))
        loop.refresh_targets()
        assert engine.url not in loop.targets
    finally:
        engine.stop()


def test_a_shard_scrapes_only_its_targets() -> None:
    from dataclasses import replace

    from kvdiag.server.targets import Shard

    urls = [f"http://10.9.0.{i}:8000" for i in range(40)]
    loops = [ScrapeLoop(replace(settings_for(urls), shard=Shard(i, 3))) for i in range(3)]  # not started
    try:
        owned = [set(loop.targets) for loop in loops]
        assert sorted(u for o in owned for u in o) == sorted(urls) and all(owned)
    finally:
        for loop in loops:
            loop.stop()


def test_a_target_claiming_thousands_of_instances_is_refused(raw_server: Callable[[Handle], str], start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    from kvdiag.refpool.emit import EngineState
    from kvdiag.engines import MAX_INSTANCES as MAX_INSTANCES_PER_TARGET

    states = [EngineState(capacity_tokens=1000, running=1) for _ in range(MAX_INSTANCES_PER_TARGET + 1)]
    body = render("vllm", states, openmetrics=False).encode()
    url = raw_server(lambda h: reply(h, 200, body))
    loop = start_loop(settings_for([url]))
    assert wait_for(lambda: loop.ready, timeout=60)  # a hang guard: 257 instances to count on a loaded machine
    state = loop.targets[url]
    assert not state.up and "instances in one exposition" in (state.error or "") and not state.instances
