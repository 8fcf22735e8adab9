"""Terminal views of the pool (rich): the three-state bar and per-field provenance."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from kvdiag.model import PoolSample

BAR_WIDTH = 24


def pool_bar(sample: PoolSample, width: int = BAR_WIDTH) -> Text:
    """used / evictable / available where the engine reports them apart, else used against
    the rest (labelled as such, since the rest mixes evictable cache and free space)."""
    cap = sample.capacity_tokens
    parts: list[tuple[float, str, str]] = []
    if cap and sample.used_tokens is not None and sample.evictable_tokens is not None and sample.available_tokens is not None:
        parts = [
            (sample.used_tokens, "red", "used"),
            (sample.evictable_tokens, "yellow", "evictable"),
            (sample.available_tokens, "green", "available"),
        ]
        legend = "used/evictable/available"
    elif sample.usage_ratio is not None:
        parts = [(sample.usage_ratio, "red", "used"), (max(0.0, 1 - sample.usage_ratio), "bright_black", "rest")]
        cap = 1.0
        legend = "used vs rest (evictable, free not split)"
    else:
        return Text("no usage reported", style="dim")
    total = cap or sum(p[0] for p in parts) or 1.0
    bar = Text()
    cells = 0
    for i, (amount, style, _) in enumerate(parts):
        n = width - cells if i == len(parts) - 1 else int(round(width * amount / total))
        n = max(0, min(n, width - cells))
        bar.append("█" * n, style=style)
        cells += n
    bar.append(f"\n{legend}", style="dim")
    return bar


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "—" if v is None else format(v, spec)


def inspect_table(samples: list[PoolSample]) -> Table:
    table = Table(title="KV pool per instance", show_lines=True, expand=False)
    for col in ("instance", "pool", "capacity", "usage", "running / waiting", "evictions", "prefix hit", "L2"):
        table.add_column(col)
    for s in samples:
        l2 = "—"
        if s.l2_capacity_tokens:
            l2 = f"{fmt(s.l2_used_tokens)} / {fmt(s.l2_capacity_tokens)} tok"
        table.add_row(
            f"{s.instance}\n[dim]{s.engine} {s.model or ''}[/dim]",
            pool_bar(s),
            f"{fmt(s.capacity_tokens)} tok",
            fmt(s.usage_ratio, ".2f") + (f" ({s.usage_granularity})" if s.usage_granularity else ""),
            f"{fmt(s.running)} / {fmt(s.waiting)}",
            fmt(s.evictions_total),
            fmt(s.prefix_hit_ratio, ".2f"),
            l2,
        )
    return table


def provenance_table(sample: PoolSample) -> Table:
    table = Table(title=f"where the numbers of {sample.instance} came from", show_header=True)
    table.add_column("field")
    table.add_column("value")
    table.add_column("source")
    for name, prov in sample.provenance.items():
        v = getattr(sample, name)
        shown = f"{v:,.4g}" if isinstance(v, float) else ("histogram, %d obs" % v.count if v is not None and hasattr(v, "count") else str(v))
        table.add_row(name, shown, prov.describe())
    return table
