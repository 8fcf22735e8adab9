"""Scripted engine timelines: known EngineState series without running a scheduler.

The exporter's tests need engines whose story is known in advance, second by second. A script
here is a function of time that returns the instance's state; ``emit.render`` turns it into
the engine's exposition. The discrete-event simulator (``sim.py``) produces the same records
from a real scheduler; scripts are for when the story itself must be fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.refpool.emit import EngineState

ONSET_S = 60.0  # the pool pins at this point of the saturation story


@dataclass
class SaturationStory:
    """The seed's story: shared-prefix load ramps until L1 is pinned; the queue grows,
    running requests are evicted and recomputed, P99 TTFT goes from ~1 s to tens of seconds,
    while the prefix hit ratio stays high and the L2 tier stays mostly empty."""

    capacity_tokens: int = 196_608
    request_rate: float = 8.0  # finished requests per second at full load
    onset_s: float = ONSET_S
    l2_capacity_tokens: int | None = 393_216

    def state(self, t: float) -> EngineState:
        st = EngineState(capacity_tokens=self.capacity_tokens, l2_capacity_tokens=self.l2_capacity_tokens)
        load = min(1.0, t / self.onset_s)
        saturated = max(0.0, t - self.onset_s)
        st.used_tokens = int(self.capacity_tokens * min(0.99, 0.3 + 0.69 * load))
        st.evictable_tokens = int((self.capacity_tokens - st.used_tokens) * 0.6)
        st.running = int(10 + 38 * load)
        st.waiting = int(saturated * 0.8)
        st.evictions_total = int(saturated * 0.5) + int(saturated * saturated / 400)
        st.last_eviction_event = 2 if saturated else 0
        st.new_token_ratio = 0.7 if not saturated else min(1.0, 0.7 + saturated / 600)
        # Each second finishes its requests; their TTFT grows with the time spent queued.
        for second in range(int(t)):
            wait = max(0.0, second - self.onset_s) * 0.35
            n = int(self.request_rate * min(1.0, second / self.onset_s + 0.2))
            for k in range(n):
                ttft = 0.3 + 0.1 * (k % 5) + wait * (0.5 + (k % 10) / 10)
                st.ttft.observe(ttft)
                st.queue_time.observe(max(0.0, ttft - 0.3))
        st.requests_total = st.ttft.n
        st.prompt_tokens_total = st.requests_total * 3_500
        st.prefix_hit_tokens_total = int(st.prompt_tokens_total * 0.8)
        st.generation_tokens_total = st.requests_total * 500
        st.l2_used_tokens = int((self.l2_capacity_tokens or 0) * 0.05)
        st.l2_hit_tokens_total = int(st.prompt_tokens_total * 0.01) if self.l2_capacity_tokens else 0
        return st
