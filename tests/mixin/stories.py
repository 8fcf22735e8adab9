"""Engines with known stories for the mixin tests: each a function of time to EngineStates.

A ``Story`` fixes what each data-parallel engine of a server does second by second (how full
the pool is, how the queue moves, how many requests are evicted, how slow first tokens are),
so the verdict is known in advance and both Prometheus and the Python checks must find it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiag.refpool.emit import EngineState, render


@dataclass(frozen=True)
class Engine:
    """One data-parallel engine's behaviour; rates are per second of the story."""

    usage: float = 0.3  # share of the pool held by running requests
    running: int = 20
    waiting_per_s: float = 0.0
    evictions_per_s: float = 0.0
    requests_per_s: float = 2.0
    ttft_s: float = 0.5
    hit_ratio: float = 0.8
    l2: bool = False
    restart_at: float | None = None  # counters start again from zero at this second
    evictions_before_restart: int = 0  # evictions counted before the restart (lost with it)

    def state(self, t: float, capacity: int = 100_000) -> EngineState:
        before = self.restart_at is not None and t < self.restart_at
        if self.restart_at is not None and t >= self.restart_at:
            t -= self.restart_at
        st = EngineState(capacity_tokens=capacity, l2_capacity_tokens=2 * capacity if self.l2 else None)
        st.used_tokens = int(capacity * self.usage)
        st.evictable_tokens = int((capacity - st.used_tokens) * 0.5)
        busy = self.requests_per_s > 0
        st.running = self.running if busy else 0
        st.waiting = int(self.waiting_per_s * t)
        st.evictions_total = int(self.evictions_per_s * t) + (self.evictions_before_restart if before else 0)
        st.last_eviction_event = 2 if self.evictions_per_s else 0
        for _ in range(int(self.requests_per_s * t)):
            st.ttft.observe(self.ttft_s)
            st.queue_time.observe(max(0.0, self.ttft_s - 0.2))
        st.requests_total = st.ttft.n
        st.prompt_tokens_total = st.requests_total * 2_000
        st.prefix_hit_tokens_total = int(st.prompt_tokens_total * self.hit_ratio)
        st.generation_tokens_total = st.requests_total * 500
        if self.l2:
            st.l2_used_tokens = capacity // 10
            st.l2_hit_tokens_total = st.prompt_tokens_total // 100
            # the host tier's traffic (SGLang's radix-cache counters): hits loaded back, prompts backed up
            st.load_back_tokens_total, st.backup_tokens_total = st.l2_hit_tokens_total, st.prompt_tokens_total // 2
            st.kv_bytes_per_token_per_rank = 163_840
        # SGLang's prefill counters: the uncached input, and the computed / cached split
        st.prefill_input_tokens_total = st.prompt_tokens_total - st.prefix_hit_tokens_total - st.l2_hit_tokens_total
        st.prefill_compute_tokens_total = st.prompt_tokens_total - st.prefix_hit_tokens_total
        st.prefill_cache_tokens_total = st.prefix_hit_tokens_total
        return st


@dataclass(frozen=True)
class Story:
    """One engine server: its engines (one per DP rank), dialect, topology and wire format."""

    name: str
    engine: str  # "sglang" | "vllm"
    dialect: str
    engines: tuple[Engine, ...]
    expected: tuple[str, ...]  # the verdict per engine, in DP order
    findings: tuple[tuple[str, ...], ...] = field(default=())  # alert-carrying findings per engine
    tp: int = 1
    escape: bool = False  # underscore-escaped names (prometheus_client >= 0.23 to Prometheus 2.x)

    def body(self, t: float, openmetrics: bool) -> str:
        states = [e.state(t) for e in self.engines]
        return render(self.engine, states, self.dialect, openmetrics=openmetrics, escape=self.escape, tp=self.tp)


SATURATED = Engine(usage=0.99, running=48, waiting_per_s=0.8, evictions_per_s=0.5, ttft_s=15.0)
IDLE = Engine(usage=0.0, running=0, requests_per_s=0.0)

#: The stories served to the real Prometheus and judged by the Python checks alike.
STORIES = (
    Story("sglang-bottleneck-tp2-escaped", "sglang", "0.5.23", (Engine(**{**SATURATED.__dict__, "l2": True}),),
          ("l1_kv_bottleneck",), (("concurrency_not_cache",),), tp=2, escape=True),
    Story("vllm-dp2", "vllm", "0.33.0", (SATURATED, Engine()), ("l1_kv_bottleneck", "healthy"),
          (("concurrency_not_cache",), ())),
    Story("sglang-dp2", "sglang", "0.5.23", (Engine(usage=0.97), Engine(usage=0.5, waiting_per_s=0.5)),
          ("near_kv_capacity", "queue_without_kv_pressure")),
    # usage 0.93 but no room to admit: 48 running x 0.7 x 500 reserved output + the next request
    Story("sglang-admission-reserve", "sglang", "0.5.23", (Engine(usage=0.93, running=48, waiting_per_s=0.8),),
          ("l1_kv_pressure",)),
    Story("vllm-legacy-0.8", "vllm", "0.8", (Engine(usage=0.99, evictions_per_s=0.5),), ("l1_kv_pressure",)),
    Story("vllm-idle", "vllm", "0.33.0", (IDLE,), ("healthy",)),
    Story("vllm-restart-no-false-evictions", "vllm", "0.33.0",
          (Engine(usage=0.99, restart_at=6.0, evictions_before_restart=50),), ("near_kv_capacity",)),
    # evictions unknown (no retraction counter), but pinned and queued: pressure at least (issue 28)
    Story("sglang-0.5.3-no-retract-counter", "sglang", "0.5.3", (Engine(usage=0.99, waiting_per_s=0.8, evictions_per_s=0.5),),
          ("l1_kv_pressure",)),
)
