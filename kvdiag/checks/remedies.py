"""Remedies with numbers: the concurrency ceiling, the admission limit the window supports, and
what each lever buys at the observed lengths.

The ceiling counts what one request holds in the pool that no other request shares (its
private footprint): the uncached part of its prompt and its output. The cached part is a prefix
already in the pool: it is held once for every request that shares it, so it is subtracted
once from the pool, not once per request::

    shared  = prompt x hit ratio                 (the prefix each request found in the pool)
    private = prompt x (1 - hit ratio) + output
    ceiling = floor((pool - shared) / private)   requests at their full length

``prompt`` and ``output`` are tokens per finished request (the engine's token and request
counters over the window; over its lifetime when nothing finished in it) and the hit ratio is
the prefix check's (hit / queried tokens from counters; an old engine's hit-rate gauge). The
usage gauges count only what running requests hold (the protected part, where an engine
reports the evictable / protected split): an evictable cached prefix nobody holds is room,
reclaimed on demand, so the pool in the ceiling is the whole capacity. The number of distinct shared
prefixes is not exported: the ceiling subtracts one of the per-request hit length, the least
the pool keeps for the hits it served. Where a request's cached part is its own (a multi-turn
history) it is not shared and the ceiling is too high; the window's own evictions bound it.

The admission limit is the ceiling cross-checked against the window (``Observed``): the
running count seen without an eviction proves that many fit (running requests part-way
through their output hold less than their full length), so the limit is never below it; the
running count at which requests were evicted proves that many did not, so the limit stays
below it, and then says so where that is below a count that once ran without evictions.
Knob names come from the engine's adapter; the texts come from the catalog.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np

from kvdiag import engines
from kvdiag.checks.base import hit_ratio, per_request, recent
from kvdiag.checks.catalog import REMEDIES
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window, counter_increase, counter_steps

Figures = dict[str, float | int | str | None]


@dataclass(frozen=True)
class Footprint:
    """What a request holds in the pool at its full length, in tokens per finished request."""

    prompt: float
    output: float
    hit_ratio: float | None  # share of prompt tokens found in the pool; None: not reported (nothing shared)

    @property
    def shared(self) -> float:
        """The cached prefix of a request: held once in the pool for all who share it."""
        return self.prompt * min(1.0, max(0.0, self.hit_ratio or 0.0))

    @property
    def private(self) -> float:
        """The uncached prompt and the output: held by this request alone."""
        return self.prompt - self.shared + self.output


def ceiling(pool_tokens: float, footprint: Footprint) -> int | None:
    """Requests ``pool_tokens`` hold at their full length: the shared prefix subtracted once
    from the pool, the rest divided by the private footprint (0 where the prefix alone fills
    the pool; None where requests hold nothing of their own, so the pool bounds nothing)."""
    if footprint.private <= 0:
        return None
    return int(max(0.0, pool_tokens - footprint.shared) // footprint.private)


def footprint(window: Window, config: Config) -> tuple[Footprint | None, str]:
    """The window's footprint per request and its basis (``window`` | ``lifetime`` |
    ``unknown``); None where no tokens per request are known."""
    prompt, prompt_basis = per_request(window, config, "prompt_tokens_total")
    output, output_basis = per_request(window, config, "generation_tokens_total")
    if not (prompt or 0.0) + (output or 0.0):
        return None, "unknown"
    return Footprint(prompt or 0.0, output or 0.0, hit_ratio(window, config)), prompt_basis if prompt is not None else output_basis


@dataclass(frozen=True)
class Observed:
    """What the window shows of how many running requests the pool held, and at what cost.

    An interval is the time between two scrapes; it evicted when the eviction counter rose
    over it (reset-safe), and was quiet when it did not. All counts are None where unknown
    (no running gauge, no eviction counter, or no such interval in the window).
    """

    running_peak: int | None  # the most running requests at any scrape
    quiet_peak: int | None  # the most running at a scrape ending a quiet interval
    evicted_at: int | None  # the fewest running around an evicting interval (the larger of its two scrapes)
    pinned_at: int | None  # running at the first scrape where the usage gauge reached saturated_usage
    evictions: float | None  # evictions counted over the window's intervals


def observed(window: Window, config: Config) -> Observed:
    """Running counts against evictions over the check span (see ``Observed``)."""
    w = recent(window, config)
    running = w.column("running")
    seen = ~np.isnan(running)
    peak = int(running[seen].max()) if seen.any() else None
    usage = w.column("usage_ratio")
    pinned = np.flatnonzero(seen & (usage >= config.saturated_usage))
    pinned_at = int(running[pinned[0]]) if len(pinned) else None
    if not w.has("evictions_total"):
        return Observed(peak, None, None, pinned_at, None)
    total = w.column("evictions_total")
    steps = counter_steps(total)
    quiet = seen & (steps == 0)
    around = np.fmax(running, np.concatenate(([np.nan], running[:-1])))
    evicting = (steps > 0) & ~np.isnan(around)
    return Observed(
        peak,
        int(running[quiet].max()) if quiet.any() else None,
        int(around[evicting].min()) if evicting.any() else None,
        pinned_at,
        counter_increase(total[~np.isnan(total)]),  # bridges a missed scrape, which ``steps`` cannot
    )


@dataclass(frozen=True)
class Limit:
    """A recommended admission limit (running requests) and why it is that number."""

    value: int
    reason: str


def admission_limit(ceiling_requests: int | None, seen: Observed) -> Limit | None:
    """The ceiling held to what the window showed (see the module docstring); None where
    neither a ceiling nor a running count without evictions is known."""
    value, reason = ceiling_requests, "the ceiling"
    if seen.quiet_peak is not None and (value is None or seen.quiet_peak > value):
        reason = "the most that ran in the window without an eviction"
        if value is not None:
            reason += " (above the ceiling: running requests part-way through their output hold less than their full length)"
        value = seen.quiet_peak
    if not value:
        return None  # no ceiling known, or a pool that holds no request whole: capping at 0 helps nothing
    if seen.evicted_at is not None and value >= seen.evicted_at:
        value = max(1, seen.evicted_at - 1)
        count = f" ({seen.evictions:,.0f} eviction{'s' if seen.evictions != 1 else ''})" if seen.evictions else ""
        reason = f"below the {seen.evicted_at:,} running at which requests were evicted in the window{count}"
        if seen.quiet_peak is not None and seen.quiet_peak > value:
            reason += f"; {seen.quiet_peak:,} ran without evictions at other times, when requests held less"
    if seen.evictions is None:
        reason += "; the engine reports no eviction counter, so the window cannot confirm it"
    elif seen.evictions == 0:
        reason += ("; no request was evicted in the window: the engine's own admission already makes requests "
                   "queue, and this limit keeps it so, it does not raise throughput")
    else:
        reason += "; requests then queue instead of being evicted and recomputed"
    return Limit(value, reason)


def figures(window: Window, config: Config) -> Figures:
    """Pool tokens, the footprint per request, the ceiling, what the window observed, the
    admission limit, and what FP8 / twice the L1 would make of the ceiling. Absent inputs
    leave their figures None."""
    cap = window.last.capacity_tokens
    fp, basis = footprint(window, config)
    seen = observed(window, config)
    top = ceiling(cap, fp) if cap and fp else None
    limit = admission_limit(top, seen)
    notes = [f"{seen.quiet_peak:,} without an eviction"] if seen.quiet_peak is not None else []
    if seen.evicted_at is not None:
        notes.append(f"requests were evicted at {seen.evicted_at:,}")
    if seen.pinned_at is not None:
        notes.append(f"the pool pinned at {seen.pinned_at:,}")
    return {
        "pool_tokens": int(cap) if cap else None,
        "avg_len": int(round(fp.prompt + fp.output)) if fp else None,
        "avg_len_basis": basis,
        "hit_ratio": fp.hit_ratio if fp else None,
        "shared_tokens": int(round(fp.shared)) if fp else None,
        "private_len": int(round(fp.private)) if fp else None,
        "ceiling": top,
        "running_peak": seen.running_peak,
        "running_quiet_peak": seen.quiet_peak,
        "running_evicted_at": seen.evicted_at,
        "running_pinned_at": seen.pinned_at,
        "running_note": "".join(f"; {n}" for n in notes),
        "limit": limit.value if limit else None,
        "limit_reason": limit.reason if limit else None,
        "fp8_pool_tokens": int(cap * 2) if cap else None,
        "fp8_ceiling": ceiling(2 * cap, fp) if cap and fp else None,
        "double_ceiling": ceiling(2 * cap, fp) if cap and fp else None,
    }


def reserve_figures(saturated: CheckResult, window: Window) -> Figures:
    """Where the saturation check fired on the output reserve alone (its ``reserve`` branch),
    what the reserve holds: the tokens beyond the need if every running request were reserved
    its whole remaining output, their share of the pool, the usage gauge and the ratio the
    engine exports; empty otherwise (the ``output_reserve`` remedy is then left out)."""
    v = saturated.evidence.values
    cap = window.last.capacity_tokens
    gap = v.get("reserve_gap_last")
    if not v.get("reserve_blocked") or v.get("short_window_pinned") or v.get("long_window_pinned"):
        return {}
    running = v.get("reserve_running")
    if not isinstance(gap, float) or not cap or not isinstance(running, float):
        return {}
    return {
        "reserve_tokens": int(round(gap * cap)),
        "reserve_share": gap,
        "reserve_usage": v.get("usage_last"),
        "reserve_running": int(running),
        "reserve_ratio": v.get("reserve_ratio_last"),
        "reserve_output": v.get("output_per_request"),
    }


def remedies(names: Iterable[str], engine: str, figs: Figures) -> list[str]:
    """The catalog's remedy texts, filled with figures and the engine's knob names; a remedy
    whose figures are unknown is given in its plain form."""
    try:
        knobs = asdict(engines.knobs(engine))
        hint = engines.enable_hint(engine)
    except KeyError:
        knobs, hint = {}, ""
    known = {k: v for k, v in figs.items() if v is not None}
    out = []
    for name in dict.fromkeys(names):
        spec = REMEDIES[name]
        try:
            out.append(spec.text.format(**known, **knobs, enable_hint=hint))
        except KeyError:
            out.append(spec.plain.format(**knobs, enable_hint=hint))
    return [r for r in out if r]
