"""Engine recordings built for the checks' tests, rendered by the reference pool's emitter.

A scenario gives, per scrape, the pool usage, the queue, evictions and the latency of the
requests that got their first token; ``recording`` renders each scrape in the chosen engine
dialect, so the tests read them through the same adapters as a real engine.
"""

from __future__ import annotations

from typing import Callable

from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Scrape
from kvdiag.refpool.emit import EngineState, content_type, render
from kvdiag.window import Window, windows

T0 = 1_795_000_000.0
TARGET = "http://10.1.2.3:30000"
PROMPT, OUTPUT = 3_000, 500  # tokens per request

Series = Callable[[int], float]


def const(v: float) -> Series:
    return lambda i: v


def ramp(start: float, per_step: float) -> Series:
    return lambda i: start + per_step * i


def recording(
    engine: str,
    steps: int = 60,
    *,
    dialect: str | None = None,
    usage: Series = const(0.4),
    waiting: Series = const(0),
    running: Series = const(20),
    evictions: Series = const(0),  # evictions in each interval
    ttft: Series = const(0.5),  # TTFT of the requests that got their first token in the interval
    requests: int = 20,  # first tokens (and finished requests) per interval
    hit: float = 0.8,
    l2_capacity: int | None = None,
    l2_used: Series = const(0),
    l2_hit: float = 0.0,
    restart_at: int | None = None,
    capacity: int = 200_000,
    interval: float = 5.0,
    openmetrics: bool = False,
    escape: bool = False,
    tp: int = 1,
    role: str = "unified",  # a PD instance's role: its queues below are exported as 0 otherwise
    prealloc: Series = const(0),  # decode: waiting for room in the pool
    transfer: Series = const(0),  # decode: preallocated, KV on its way
    new_token_ratio: Series = const(0.7),  # SGLang's reserve ratio (vLLM exports none)
) -> list[Scrape]:
    def fresh() -> EngineState:
        return EngineState(capacity_tokens=capacity, l2_capacity_tokens=l2_capacity, role=role)

    state = fresh()
    out = []
    for i in range(steps):
        if restart_at is not None and i == restart_at:
            state = fresh()  # a restarted engine: every counter from zero
        used = int(round(usage(i) * capacity))
        state.used_tokens = used
        state.evictable_tokens = min(capacity - used, capacity // 20)
        state.waiting, state.running = int(waiting(i)), int(running(i))
        state.prealloc_queue, state.transfer_queue = int(prealloc(i)), int(transfer(i))
        state.new_token_ratio = new_token_ratio(i)
        new_evictions = int(evictions(i))
        state.evictions_total += new_evictions
        state.last_eviction_event = new_evictions
        for _ in range(requests):
            state.ttft.observe(ttft(i))
            state.queue_time.observe(max(0.0, ttft(i) - 0.2))
        state.requests_total += requests
        state.prompt_tokens_total += requests * PROMPT
        state.generation_tokens_total += requests * OUTPUT
        hits, l2_hits = int(requests * PROMPT * hit), int(requests * PROMPT * l2_hit)
        state.prefix_hit_tokens_total += hits
        state.l2_hit_tokens_total += l2_hits
        # SGLang's prefill counters: the uncached input, and the computed / cached split
        state.prefill_input_tokens_total += requests * PROMPT - hits - l2_hits
        state.prefill_compute_tokens_total += requests * PROMPT - hits
        state.prefill_cache_tokens_total += hits
        state.l2_used_tokens = int(l2_used(i))
        body = render(engine, [state], dialect, openmetrics=openmetrics, escape=escape, tp=tp)
        out.append(Scrape(T0 + i * interval, TARGET, content_type(openmetrics), body))
    return out


def samples(scrapes: list[Scrape]) -> list[PoolSample]:
    return [s for scrape in scrapes for s in normalize_scrape(scrape)]


def window(scrapes: list[Scrape]) -> Window:
    (w,) = windows(samples(scrapes)).values()
    return w
