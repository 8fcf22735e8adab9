"""What both engine adapters share: reading one figure out of a family across topology labels.

An engine's exposition describes one server, which may hold several data-parallel engines
(each its own KV pool, so its own kvdiag instance) and, within each, tensor/pipeline-parallel
ranks that report the same figures again. The helpers here pick the samples of one instance,
collapse duplicates (max over TP/PP ranks and multiprocess pids, which all see the same pool)
and add up true partitions (streaming vs non-streaming requests, finish reasons).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable

from kvdiag.exposition import Exposition, Family, Sample
from kvdiag.model import Histogram, PoolSample, Provenance, violation

#: Labels whose values repeat one engine's figures (ranks of one model replica, processes).
DUPLICATE_LABELS = frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "attn_cp_rank", "pid"})


@dataclass
class Knobs:
    """The engine's own flag names for the levers the remedies talk about."""

    admission_limit: str
    kv_dtype_fp8: str
    tensor_parallel: str
    data_parallel: str
    memory_fraction: str
    enable_metrics: str
    kv_pool_size: str  # the KV pool's size set directly
    reserve_conservativeness: str  # how much of running requests' future output admission reserves ("" where none)
    reserve_clip: str | None = None  # caps the output admission charges one request (None where none)


@dataclass
class Instance:
    """One instance of a server: its key, the split label (if any) and model name."""

    key: str
    split: dict[str, str] = field(default_factory=dict)
    model: str | None = None


def instance_key(target: str, split: dict[str, str]) -> str:
    """The target plus the labels that split it, e.g. ``http://h:8000 engine=1``."""
    return " ".join([target] + [f"{k}={v}" for k, v in sorted(split.items())])


@dataclass
class _Groups:
    """One family's samples keyed by (suffix, values of the split labels; None where missing)."""

    size: int  # len(fam.samples) when built: a family that grew afterwards is regrouped
    by_key: dict[tuple[str, tuple[str | None, ...]], list[Sample]]
    wide: set[str]  # suffixes with a sample that carries none of the split labels


def _groups(fam: Family, keys: tuple[str, ...]) -> _Groups:
    """Group a family once per split-label set, so that N instances cost O(samples), not O(N x samples)."""
    got = fam.groups.get(keys)
    if got is None or got.size != len(fam.samples):
        by_key: dict[tuple[str, tuple[str | None, ...]], list[Sample]] = {}
        wide: set[str] = set()
        for s in fam.samples:
            vals = tuple(s.labels.get(k) for k in keys)
            by_key.setdefault((s.suffix, vals), []).append(s)
            if keys and all(v is None for v in vals):
                wide.add(s.suffix)
        got = fam.groups[keys] = _Groups(len(fam.samples), by_key, wide)
    return got


def members(fam: Family, split: dict[str, str], suffix: str) -> list[Sample]:
    """The samples of one suffix that belong to an instance, in exposition order: those that
    carry its split labels or none of them. Server-wide series (SGLang's tokenizer process has
    no ``dp_rank``) belong to every instance of the server; ``server_wide`` says when that
    happened."""
    keys = tuple(sorted(split))
    by_key = _groups(fam, keys).by_key
    if not keys:
        return by_key.get((suffix, ()), [])
    parts = [by_key.get((suffix, combo), ()) for combo in itertools.product(*[(split[k], None) for k in keys])]
    picked = [s for part in parts for s in part]
    if sum(1 for part in parts if part) > 1:
        picked.sort(key=lambda s: s.offset)
    return picked


def server_wide(fam: Family, split: dict[str, str], suffix: str | None = None) -> bool:
    """Whether some sample (of ``suffix``, or of any suffix) carries none of the split labels."""
    if not split:
        return False
    wide = _groups(fam, tuple(sorted(split))).wide
    return bool(wide) if suffix is None else suffix in wide


def _combine(samples: list[Sample], sum_over: tuple[str, ...]) -> float | None:
    """Max within each group of duplicates, summed over the ``sum_over`` partitions."""
    groups: dict[tuple[str, ...], float] = {}
    for s in samples:
        key = tuple(s.labels.get(lbl, "") for lbl in sum_over)
        prev = groups.get(key)
        v = s.value
        if prev is None or (v > prev) or (math.isnan(prev) and not math.isnan(v)):
            groups[key] = v
    if not groups:
        return None
    return float(sum(groups.values()))


def value(
    fam: Family | None,
    split: dict[str, str],
    suffix: str = "",
    select: dict[str, str] | None = None,
    sum_over: tuple[str, ...] = (),
) -> float | None:
    """One figure of one instance from a family, or None when no sample applies."""
    if fam is None:
        return None
    picked = members(fam, split, suffix)
    if select is not None:
        picked = [s for s in picked if all(s.labels.get(k) == v for k, v in select.items())]
    return _combine(picked, sum_over)


def record_writers(sample: PoolSample, field_name: str, fam: Family | None, split: dict[str, str], suffix: str = "") -> None:
    """Keep a per-process gauge's value per ``pid`` when several processes wrote it.

    A gauge left in prometheus_client's "all" multiprocess mode is one series per writing
    process, and a process that stopped writing (or died: "all" files outlive their process)
    keeps its last value. The field holds the max for now (``value``); the window replaces it with the most
    recent writer's value (``kvdiag.window.resolve_writers``), which only history can tell."""
    if fam is None or getattr(sample, field_name) is None:
        return
    per_pid: dict[str, list[Sample]] = {}
    for s in members(fam, split, suffix):
        if "pid" in s.labels:
            per_pid.setdefault(s.labels["pid"], []).append(s)
    values = {pid: _combine(group, ()) for pid, group in per_pid.items()}
    clean = {pid: v for pid, v in values.items() if v is not None and violation(field_name, v) is None}
    if len(clean) >= 2:
        sample.writers[field_name] = clean


class InvalidHistogram(ValueError):
    """A histogram whose samples contradict each other or are no numbers; says which."""


def histogram(
    fam: Family | None, split: dict[str, str], sum_over: tuple[str, ...] = ()
) -> Histogram | None:
    """A family's cumulative histogram for one instance, partitions added bucket by bucket.

    None when the instance has no buckets (or no ``+Inf`` bucket); ``InvalidHistogram`` when
    the buckets cannot be a histogram: a bound that is no number, a count that is not a
    finite non-negative number, counts that decrease towards ``+Inf``, or a ``_count`` that
    differs from the ``+Inf`` bucket. A non-finite ``_sum`` only loses the sum.
    """
    if fam is None:
        return None
    by_le: dict[float, list[Sample]] = {}
    for s in members(fam, split, "_bucket"):
        if "le" in s.labels:
            by_le.setdefault(_bound(s.labels["le"]), []).append(s)
    if not by_le or math.inf not in by_le:
        return None
    bounds = tuple(sorted(by_le))
    counts = tuple(_combine(by_le[b], sum_over) or 0.0 for b in bounds)
    for b, c in zip(bounds, counts):
        if not (math.isfinite(c) and c >= 0):
            raise InvalidHistogram(f"bucket le={b:g} holds {c!r}, not a finite count")
    for (b0, c0), (b1, c1) in zip(zip(bounds, counts), zip(bounds[1:], counts[1:])):
        if c1 < c0:
            raise InvalidHistogram(f"cumulative buckets decrease: le={b0:g} holds {c0:g}, le={b1:g} holds {c1:g}")
    total = value(fam, split, "_count", sum_over=sum_over)
    if total is not None and total != counts[-1]:
        raise InvalidHistogram(f"_count {total!r} differs from the +Inf bucket {counts[-1]:g}")
    hsum = value(fam, split, "_sum", sum_over=sum_over)
    if hsum is None or not math.isfinite(hsum):
        hsum = math.nan
    return Histogram(bounds, counts, hsum, counts[-1])


def _bound(le: str) -> float:
    """A bucket's upper bound; Prometheus' own parsing (Go ParseFloat) of the ``le`` label."""
    try:
        b = float(le) if "_" not in le else math.nan
    except ValueError:
        b = math.nan
    if math.isnan(b):
        raise InvalidHistogram(f"bucket bound le={le!r} is not a number")
    return b


def split_values(families: Iterable[Family | None], label: str) -> list[str]:
    """The values a split label takes on the given families, in numeric-aware order."""
    seen: set[str] = set()
    for fam in families:
        if fam is None:
            continue
        for s in fam.samples:
            if label in s.labels:
                seen.add(s.labels[label])
    return sorted(seen, key=lambda v: (len(v), v))


def model_name(families: Iterable[Family | None], split: dict[str, str]) -> str | None:
    for fam in families:
        if fam is None:
            continue
        for s in members(fam, split, ""):
            if "model_name" in s.labels:
                return s.labels["model_name"]
    return None


def first(expo: Exposition, *names: str) -> tuple[str, Family] | tuple[None, None]:
    """The first of several name variants present in the exposition."""
    for name in names:
        fam = expo.get(name)
        if fam is not None and fam.samples:
            return name, fam
    return None, None


def put(
    sample: PoolSample,
    field_name: str,
    fam_name: str | None,
    fam: Family | None,
    split: dict[str, str],
    *,
    suffix: str = "",
    select: dict[str, str] | None = None,
    sum_over: tuple[str, ...] = (),
    note: str = "",
) -> float | None:
    """Read one figure into a PoolSample field with its provenance; returns the value."""
    if fam_name is None or fam is None:
        return None
    v = value(fam, split, suffix, select, sum_over)
    if v is None:
        return None
    metric = fam_name + suffix
    if select:
        metric += "{" + ",".join(f'{k}="{val}"' for k, val in select.items()) + "}"
    if math.isnan(v):
        # The engine says "no number" (SGLang exports NaN for some gauges): absent, not 0.
        sample.notes.append(f"{metric} is NaN; treated as absent")
        return None
    if server_wide(fam, split, suffix):
        note = "; ".join(x for x in (note, "server-wide series, not split by " + ",".join(split)) if x)
    return v if sample.set(field_name, v, Provenance(metric, note=note)) else None


def put_histogram(
    sample: PoolSample,
    field_name: str,
    fam_name: str | None,
    fam: Family | None,
    split: dict[str, str],
    sum_over: tuple[str, ...] = (),
) -> None:
    if fam_name is None or fam is None:
        return
    note = "server-wide series, not split by " + ",".join(split) if server_wide(fam, split) else ""
    try:
        h = histogram(fam, split, sum_over)
    except InvalidHistogram as exc:
        sample.invalidate(field_name, Provenance(fam_name, note=note), str(exc))
        return
    if h is None:
        return
    sample.set(field_name, h, Provenance(fam_name, note=note))
