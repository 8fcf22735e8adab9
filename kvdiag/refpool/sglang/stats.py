"""What the SGLang reference scheduler exposes to the metric emitter.

Field names follow the ``sglang:*`` metric each one feeds (facts/engine-metrics.md §2.3-2.5).
HiCache fields are None when ``--enable-hierarchical-cache`` is off: SGLang then does not export
those series at all, and absent must stay distinct from zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerCounters:
    """Cumulative counters the scheduler itself bumps (the rest live in the radix cache)."""

    num_retracted_requests_total: int = 0
    num_retracted_input_tokens_total: int = 0  # sum of prompt lengths of retracted requests
    num_retracted_output_tokens_total: int = 0  # sum of output lengths thrown away
    prompt_tokens_total: int = 0  # per finished request
    generation_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted_requests_total: int = 0
    cached_tokens_device_total: int = 0  # cached_tokens_total{cache_source="device"} (at admission)
    cached_tokens_host_total: int = 0  # cached_tokens_total{cache_source="host"}
    prefill_effective_input_tokens_total: int = 0  # prefill_effective_tokens_total{mode="input"}
    prefill_compute_tokens_total: int = 0  # realtime_tokens_total{mode="prefill_compute"} (recomputes too)
    prefill_cache_tokens_total: int = 0  # realtime_tokens_total{mode="prefill_cache"}
    num_prefill_batches: int = 0


@dataclass(slots=True)
class SGLangStats:
    """A snapshot of the scheduler, built anew on every read and never changed (the loop reads
    one after every step, twice: not frozen, whose ``__init__`` costs four times a plain one)."""

    max_total_num_tokens: int
    page_size: int
    max_running_requests: int
    kv_available_tokens: int  # allocator.available_size()
    kv_evictable_tokens: int  # radix tree, unlocked
    kv_protected_tokens: int  # radix tree, locked by running requests
    num_running_reqs: int  # running batch size (released requests stay until filtered)
    num_queue_reqs: int
    new_token_ratio: float
    cache_hit_rate: float  # latest prefill batch, retracted re-prefills excluded
    num_retracted_reqs: int  # gauge: size of the last retraction since the previous report
    evicted_tokens_total: int  # device slots freed by radix eviction (incl. HiCache demotes)
    forward_ct_decode: int  # decode steps run (gauges refresh every decode_log_interval of them)
    hicache_host_used_tokens: int | None
    hicache_host_total_tokens: int | None
    load_back_tokens_total: int | None
    hicache_backup_tokens_total: int | None
    hicache_dropped_tokens_total: int | None
    num_retracted_requests_total: int
    num_retracted_input_tokens_total: int
    num_retracted_output_tokens_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_requests_total: int
    num_aborted_requests_total: int
    cached_tokens_device_total: int
    cached_tokens_host_total: int
    prefill_effective_input_tokens_total: int
    prefill_compute_tokens_total: int
    prefill_cache_tokens_total: int
    num_prefill_batches: int

    @property
    def kv_used_tokens(self) -> int:
        """``num_used = max_total - (available + evictable)``: the pool SGLang calls used."""
        return self.max_total_num_tokens - self.kv_available_tokens - self.kv_evictable_tokens

    @property
    def token_usage(self) -> float:
        """``sglang:token_usage``: used / max_total, rounded to 2 decimals like the gauge."""
        return round(self.kv_used_tokens / self.max_total_num_tokens, 2)
