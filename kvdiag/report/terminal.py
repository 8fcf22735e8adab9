"""Terminal views of the pool (rich): the three-state bar, per-field provenance, and tables
that fit the terminal they are drawn on.

A name cut to "l1_kv_bottle…" or "KvdiagL1KVPo…" cannot be searched for, pasted into a query
or matched against the runbook, and a narrow terminal (80 columns, or a pipe, where rich
assumes 80) is where a newcomer first reads kvdiag. So a table is drawn by ``Fitted``: names
(the columns marked ``no_wrap``) are never cut or wrapped; prose columns wrap at words; when
that is not enough, the columns a table names as droppable go in the order it states (the
caption says which); and past that each row is drawn as a record, one field per line.
"""

from __future__ import annotations

import copy
from typing import Iterator, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

from kvdiag.model import PoolSample

BAR_WIDTH = 24


def pool_bar(sample: PoolSample, width: int = BAR_WIDTH) -> Text:
    """used / evictable / available where the engine reports them apart, else used against
    the rest (labelled as such, since the rest mixes evictable cache and free space). A hybrid
    model's split is its binding pool's, against that pool's own capacity, and says which."""
    binding = sample.binding_pool
    cap = binding.capacity if binding is not None and binding.capacity else sample.capacity_tokens
    parts: list[tuple[float, str, str]] = []
    if cap and sample.used_tokens is not None and sample.evictable_tokens is not None and sample.available_tokens is not None:
        parts = [
            (sample.used_tokens, "red", "used"),
            (sample.evictable_tokens, "yellow", "evictable"),
            (sample.available_tokens, "green", "available"),
        ]
        legend = "used/evictable/available" + (f" of the {binding.title} (binding)" if binding is not None else "")
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


def inspect_table(samples: list[PoolSample]) -> Fitted:
    """The pool per instance; at a narrow width each instance becomes a record (``Fitted``)."""
    table = Table(title="KV pool per instance", show_lines=True, expand=False)
    for col in ("instance", "pool", "capacity", "usage", "running / waiting", "evictions", "prefix hit", "L2"):
        table.add_column(col, no_wrap=True)
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
    return Fitted(table)


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


class Fitted:
    """A table drawn to fit the width it gets (see the module docstring): as built when it
    fits; else names at full width and prose wrapped at words; else without the ``drop``
    columns, first to last, until it fits; else one record per row."""

    def __init__(self, table: Table, drop: Sequence[str] = ()) -> None:
        self.table = table
        self.drop = tuple(drop)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        table, dropped = self.table, []
        for header in (None, *self.drop):
            if header is not None:
                table = _without(table, header)
                dropped.append(header)
            fitted = _fit(console, options, table)
            if fitted is not None:
                if dropped:
                    fitted.caption = f"not shown at {width} columns: {', '.join(dropped)} (a wider terminal shows them)"
                yield fitted
                return
        yield from _records(self.table)


def _fit(console: Console, options: ConsoleOptions, table: Table) -> Table | None:
    """The table, or a copy sized so that it fits: no_wrap columns at their widest cell, the
    other columns sharing the rest in proportion to their longest word; None when even that
    is wider than the terminal."""
    wide = options.update_width(10_000)
    if Measurement.get(console, wide, table).maximum <= options.max_width:
        return table
    sized = _copy(table)
    for col in sized.columns:
        cells = [col.header, *col.cells]
        if col.no_wrap:
            col.width = max(Measurement.get(console, wide, c).maximum for c in cells)
        else:
            col.ratio = max(1, max(Measurement.get(console, wide, c).minimum for c in cells))
            col.min_width = col.ratio  # counts in the minimum below; rich's flex split honours the ratio
    if Measurement.get(console, wide, sized).minimum > options.max_width:
        return None
    for col in sized.columns:
        col.min_width = None
    sized.expand = True
    return sized


def _copy(table: Table) -> Table:
    out = copy.copy(table)
    out.columns = [copy.copy(c) for c in table.columns]
    return out


def _without(table: Table, header: str) -> Table:
    out = _copy(table)
    out.columns = [c for c in out.columns if c.header != header]
    return out


def _records(table: Table) -> Iterator[Table]:
    """Each row as a two-column record (field, value): fits any terminal a name fits in."""
    columns: list[Column] = table.columns
    rows = list(zip(*(list(c.cells) for c in columns)))
    for i, row in enumerate(rows):
        record = Table.grid(padding=(0, 2))
        record.add_column(style="bold", no_wrap=True)
        record.add_column(overflow="fold")  # a token wider than the terminal (PromQL) folds, never "…"
        if i == 0 and table.title:
            record.title, record.title_justify = table.title, "left"
        for col, cell in zip(columns, row):
            record.add_row(str(col.header), cell)
        yield record
        yield Text("")
