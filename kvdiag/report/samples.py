"""The JSON shape of one instance's normalized pool: ``inspect --json`` and the exporter's API.

``{"instance", "engine", "model", "ts", "kv_usage", "usage_granularity", "capacity_tokens",
"used_tokens", "evictable_tokens", "available_tokens", "running", "waiting", "evictions_total",
"prefix_hit_ratio", "l2_used_tokens", "l2_capacity_tokens", "ttft_observations", "provenance",
"notes"}``. It lives here, beside the diagnosis rendering (``report/json.py``), so that both
surfaces that show a sample (the CLI's ``inspect`` and the exporter's ``/api/v1/instances``)
render it from one module below them, and neither imports the other. Absent stays ``null``.
"""

from __future__ import annotations

from kvdiag.model import PoolSample


def sample_json(sample: PoolSample) -> dict:
    """The documented ``inspect --json`` shape for one instance (plus a few more keys)."""
    return {
        "instance": sample.instance,
        "engine": sample.engine,
        "model": sample.model,
        "ts": sample.ts,
        "kv_usage": sample.usage_ratio,
        "usage_granularity": sample.usage_granularity,
        "capacity_tokens": _int(sample.capacity_tokens),
        "used_tokens": _int(sample.used_tokens),
        "evictable_tokens": _int(sample.evictable_tokens),
        "available_tokens": _int(sample.available_tokens),
        "running": sample.running,
        "waiting": sample.waiting,
        "evictions_total": sample.evictions_total,
        "prefix_hit_ratio": sample.prefix_hit_ratio,
        "l2_used_tokens": _int(sample.l2_used_tokens),
        "l2_capacity_tokens": _int(sample.l2_capacity_tokens),
        "ttft_observations": sample.ttft.count if sample.ttft else None,
        "provenance": {k: v.describe() for k, v in sample.provenance.items()},
        "notes": sample.notes,
    }


def _int(v: float | None) -> int | None:
    """Token counts print as integers; a derived count (usage x capacity) is rounded, not cut."""
    return None if v is None else int(round(v))
