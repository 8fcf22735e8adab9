"""A self-contained HTML report: verdicts, evidence, remedies and plots over the window.

One file, no scripts, no fonts, no network: the plots are inline SVG drawn here, so the
report opens offline, attaches to a ticket and survives a mail gateway. Per instance: the KV
pool (used / evictable / available where the engine reports them apart, else active usage),
admission usage against the saturation threshold, the queue, evictions per minute, the TTFT quantile against the SLO, the prefix hit ratio and
L2, with a marker at each moment a check started firing and a band of the verdict over time.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from kvdiag.checks.timeline import Timeline, timeline
from kvdiag.config import Config
from kvdiag.model import Diagnosis
from kvdiag.report.ticks import round_axis, time_ticks
from kvdiag.window import Window

W, H = 560, 214  # chart size
ML, MR, MB = 56, 12, 26  # margins; the top one holds the title and the legend rows under it
TITLE_H, LEGEND_ROW_H = 20, 14
LEGEND_CHAR_W = 6.0  # px per character of a 10px legend label (generous: labels must not overlap)

CHECK_COLORS = {
    "kv_usage_saturated": "#d62728",
    "queue_growing": "#ff7f0e",
    "evictions_growing": "#9467bd",
    "ttft_p99_high": "#8c564b",
    "prefix_hit_high": "#2ca02c",
    "l2_underused": "#17becf",
}
VERDICT_COLORS = {
    "l1_kv_bottleneck": "#d62728",
    "l1_kv_pressure": "#ff9f1c",
    "near_kv_capacity": "#4ea8de",
    "queue_without_kv_pressure": "#ffd166",
    "healthy": "#57cc99",
    "unknown": "#b8b8b8",
}

Values = Sequence[float | None]


@dataclass
class Line:
    label: str
    ys: Values
    color: str
    dashed: bool = False


@dataclass
class Chart:
    title: str
    unit: str
    xs: Sequence[float]
    lines: list[Line] = field(default_factory=list)
    stacked: list[Line] = field(default_factory=list)  # areas, bottom first
    hlines: list[tuple[float, str, str]] = field(default_factory=list)  # (y, label, color)
    y_max: float | None = None
    empty: str = ""  # shown instead of a plot when there is nothing to draw


def write_report(
    path: str | Path, diagnoses: Sequence[Diagnosis], windows: Mapping[str, Window], config: Config,
    extra: Mapping[str, str] | None = None,
) -> None:  # fmt: skip
    Path(path).write_text(render(diagnoses, windows, config, extra), encoding="utf-8")


def render(diagnoses: Sequence[Diagnosis], windows: Mapping[str, Window], config: Config, extra: Mapping[str, str] | None = None) -> str:
    """The report; ``extra`` appends an HTML fragment to an instance's section (whatif's)."""
    sections = []
    for d in diagnoses:
        w = windows.get(d.instance)
        sections.append(_instance(d, w, timeline(w, config) if w is not None and len(w) > 1 else None, config)
                        + (extra or {}).get(d.instance, ""))  # fmt: skip
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    rows = "".join(
        f"<tr><td><a href='#i{i}'>{_e(d.instance)}</a></td><td>{_e(d.engine)}</td><td>{_badge(d.verdict.name)}</td>"
        f"<td>{_e(', '.join(f.name for f in d.findings)) or '—'}</td></tr>"
        for i, d in enumerate(diagnoses)
    )
    thresholds = ", ".join(f"{k}={v}" for k, v, _ in config.describe())
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>kvdiag report</title><style>{_CSS}</style></head><body>"
        f"<h1>kvdiag: is the GPU KV pool (L1) what caps concurrency?</h1>"
        f"<p class='dim'>generated {generated}; thresholds: {_e(thresholds)}</p>"
        f"<table class='summary'><tr><th>instance</th><th>engine</th><th>verdict</th><th>findings</th></tr>{rows}</table>"
        + "".join(f"<section id='i{i}'>{s}</section>" for i, s in enumerate(sections))
        + "</body></html>"
    )


def _instance(d: Diagnosis, w: Window | None, tl: Timeline | None, config: Config) -> str:
    checks = "".join(
        f"<tr><td>{_e(c.check)}</td><td class='st {c.status}'>{c.status}</td><td>{_e(c.evidence.summary)}"
        + (f"<div class='dim'>{_e(c.hint)}</div>" if c.status == "unknown" and c.hint else "")
        + "</td></tr>"
        for c in d.checks.values()
    )
    findings = "".join(f"<li><b>{_e(f.name)}</b>: {_e(f.text)}</li>" for f in d.findings)
    remedies = "".join(f"<li>{_e(r)}</li>" for r in d.remedies)
    onsets = tl.onsets() if tl else {}
    marks = [(t, c, CHECK_COLORS.get(c, "#333")) for c, ts in onsets.items() for t in ts]
    onset_list = "".join(
        f"<li><span class='sw' style='background:{CHECK_COLORS.get(c, '#333')}'></span>{_e(c)} "
        + (f"firing from the start ({_clock(t)})" if tl and t == tl.ts[0] else f"started firing at {_clock(t)}")
        + "</li>"
        for c, ts in onsets.items()
        for t in ts
    )
    plots = ""
    if w is not None and len(w) > 1 and tl is not None:
        charts = _charts(w, tl, config)
        t0, t1 = w.start, w.end
        plots = (
            "<h3>over the window</h3>"
            + _verdict_band(tl, t0, t1)
            + "<div class='charts'>"
            + "".join(_svg(c, t0, t1, marks) for c in charts)
            + "</div>"
            + (f"<h3>when checks started firing</h3><ul class='onsets'>{onset_list}</ul>" if onset_list else "")
        )
    elif w is not None:
        plots = "<p class='dim'>one sample: point-in-time answers only, no plots over time.</p>"
    return (
        f"<h2>{_e(d.instance)} <span class='dim'>{_e(d.engine)} {_e(d.model or '')}</span></h2>"
        f"<p>{_badge(d.verdict.name)} {_e(d.verdict.reason)}</p>"
        f"<table class='checks'><tr><th>check</th><th>status</th><th>evidence</th></tr>{checks}</table>"
        + (f"<h3>findings</h3><ul>{findings}</ul>" if findings else "")
        + (f"<h3>remedies</h3><ul>{remedies}</ul>" if remedies else "")
        + plots
    )


def _charts(w: Window, tl: Timeline, config: Config) -> list[Chart]:
    xs = list(w.column("ts"))
    col = lambda name: _opt(w.column(name))  # noqa: E731
    pool = Chart("KV pool (L1)", "tokens", xs)
    if w.has("evictable_tokens") and w.has("available_tokens") and w.has("used_tokens"):
        pool.stacked = [
            Line("used", col("used_tokens"), "#d62728"),
            Line("evictable", col("evictable_tokens"), "#ffbf69"),
            Line("available", col("available_tokens"), "#57cc99"),
        ]
    elif w.has("usage_ratio"):
        usage = col("usage_ratio")
        pool = Chart("KV pool (L1): active usage", "ratio", xs, y_max=1.0)
        rest = [None if u is None else max(0.0, 1 - u) for u in usage]
        pool.stacked = [Line("used", usage, "#d62728"), Line("evictable + free (not reported apart)", rest, "#d9d9d9")]
        pool.hlines = [(config.saturated_usage, f"saturated ({config.saturated_usage:g})", "#d62728")]
    else:
        pool.empty = "no usage reported"
    admission = Chart("KV admission usage (usage + the room the next admission needs)", "ratio", tl.ts,
                      [Line("admission usage", tl.values.get("admission_usage", []), "#d62728")], y_max=1.0)
    admission.hlines = [(config.saturated_usage, f"saturated ({config.saturated_usage:g})", "#d62728")]
    queue = Chart("queue", "requests", xs, [Line("waiting", col("waiting"), "#ff7f0e"), Line("running", col("running"), "#1f77b4")])
    evictions = Chart("evictions (retract / preempt) per minute", "/min", xs, [Line("evictions", _per_minute(w, "evictions_total"), "#9467bd")])
    if not w.has("evictions_total"):
        evictions.empty = "no eviction counter reported"
    pct = f"P{config.ttft_quantile * 100:g}"
    ttft = Chart(f"{pct} TTFT over the trailing {config.window:g}s window", "s", tl.ts, [Line(pct, tl.values.get("ttft_quantile", []), "#8c564b")])
    ttft.hlines = [(config.ttft_slo, f"SLO {config.ttft_slo:g}s", "#d62728")]
    hit = Chart("prefix hit ratio over the trailing window", "ratio", tl.ts, [Line("hit ratio", tl.values.get("hit_ratio", []), "#2ca02c")], y_max=1.0)
    hit.hlines = [(config.prefix_hit_high, f"high ({config.prefix_hit_high:g})", "#2ca02c")]
    l2 = Chart("L2 (host tier) occupancy", "ratio", xs, y_max=1.0)
    if w.has("l2_capacity_tokens") and w.has("l2_used_tokens"):
        used, cap = w.column("l2_used_tokens"), w.column("l2_capacity_tokens")
        with np.errstate(divide="ignore", invalid="ignore"):
            l2.lines = [Line("occupancy", _opt(np.where(cap > 0, used / cap, np.nan)), "#17becf")]
    else:
        l2.empty = "no L2 occupancy reported"
    return [pool, admission, queue, evictions, ttft, hit, l2]


def _per_minute(w: Window, name: str) -> list[float | None]:
    """Reset-safe increase between consecutive samples, per minute (a restart is not a spike)."""
    ts, vals = w.column("ts"), w.column(name)
    out: list[float | None] = [None]
    for i in range(1, len(vals)):
        a, b, dt = vals[i - 1], vals[i], ts[i] - ts[i - 1]
        if math.isnan(a) or math.isnan(b) or dt <= 0:
            out.append(None)
        else:
            out.append((b if b < a else b - a) * 60.0 / dt)
    return out


def _svg(c: Chart, t0: float, t1: float, marks: list[tuple[float, str, str]]) -> str:
    head = f"<svg class='chart' role='img' viewBox='0 0 {W} {H}' width='{W}' height='{H}' xmlns='http://www.w3.org/2000/svg'>"
    title = f"<text x='{ML}' y='14' class='t'>{_e(c.title)}</text>"
    if c.empty:
        return head + title + f"<text x='{W / 2}' y='{H / 2}' class='empty' text-anchor='middle'>{_e(c.empty)}</text></svg>"
    legend, rows = _legend([(ln.label, ln.color) for ln in c.stacked + c.lines])
    mt = TITLE_H + LEGEND_ROW_H * rows + 6  # the plot starts below the title and the legend
    pw, ph = W - ML - MR, H - mt - MB
    tops = _stack_tops(c) if c.stacked else []
    values = [v for layer in tops for v in layer if v is not None] + [v for ln in c.lines for v in ln.ys if v is not None]
    axis = round_axis(c.y_max or max(values + [y for y, _, _ in c.hlines] + [0.0]))
    ymax = axis.top
    span = max(t1 - t0, 1e-9)
    x = lambda t: ML + pw * (t - t0) / span  # noqa: E731
    y = lambda v: mt + ph * (1 - min(max(v / ymax, 0.0), 1.0))  # noqa: E731
    parts = [head, title, legend, f"<rect x='{ML}' y='{mt}' width='{pw}' height='{ph}' class='bg'/>"]
    for v in axis.ticks:
        parts.append(f"<line x1='{ML}' x2='{ML + pw}' y1='{y(v):.1f}' y2='{y(v):.1f}' class='grid'/>")
        parts.append(f"<text x='{ML - 4}' y='{y(v) + 4:.1f}' class='ax yt' text-anchor='end'>{axis.label(v)}</text>")
    ticks, step = time_ticks(t0, t1)
    for t in ticks:
        anchor = "start" if x(t) - ML < 24 else "end" if ML + pw - x(t) < 24 else "middle"
        label = _clock(t)[:-3] if step >= 60 else _clock(t)
        parts.append(f"<line x1='{x(t):.1f}' x2='{x(t):.1f}' y1='{mt + ph}' y2='{mt + ph + 3}' class='grid'/>")
        parts.append(f"<text x='{x(t):.1f}' y='{H - 8}' class='ax xt' text-anchor='{anchor}'>{label}</text>")
    lower: list[float | None] = [0.0] * len(c.xs)
    for layer, top in zip(c.stacked, tops):
        parts.append(_area(c.xs, lower, top, x, y, layer))
        lower = top
    for ln in c.lines:
        parts.append(_path(c.xs if len(ln.ys) == len(c.xs) else c.xs[: len(ln.ys)], ln, x, y))
    for v, label, color in c.hlines:
        parts.append(f"<line x1='{ML}' x2='{ML + pw}' y1='{y(v):.1f}' y2='{y(v):.1f}' stroke='{color}' class='hl'/>")
        ly = y(v) - 3 if y(v) - mt > 14 else y(v) + 11  # below the line when it runs along the top
        parts.append(f"<text x='{ML + 4}' y='{ly:.1f}' class='ax' fill='{color}'>{_e(label)}</text>")
    for t, check, color in marks:
        parts.append(
            f"<line x1='{x(t):.1f}' x2='{x(t):.1f}' y1='{mt}' y2='{mt + ph}' stroke='{color}' class='mark'>"
            f"<title>{_e(check)} started firing at {_clock(t)}</title></line>"
        )
    return "".join(parts) + "</svg>"


def _legend(entries: list[tuple[str, str]]) -> tuple[str, int]:
    """The legend in rows under the title, left to right, a new row when one is full (so it
    never runs into the title); the SVG and the number of rows it took."""
    parts, rows, lx = [], 0, float(W)
    for label, color in entries:
        width = 13 + LEGEND_CHAR_W * len(label) + 14
        if lx + width > W - MR:
            rows, lx = rows + 1, float(ML)
        ty = TITLE_H + LEGEND_ROW_H * rows - 3
        parts.append(
            f"<rect class='lg' x='{lx:.1f}' y='{ty - 9}' width='10' height='10' fill='{color}'/>"
            f"<text x='{lx + 13:.1f}' y='{ty}' class='ax'>{_e(label)}</text>"
        )
        lx += width
    return "".join(parts), rows


def _stack_tops(c: Chart) -> list[list[float | None]]:
    """Cumulative tops of the stacked layers; a point missing in any layer below is missing."""
    tops: list[list[float | None]] = []
    acc: list[float | None] = [0.0] * len(c.xs)
    for layer in c.stacked:
        acc = [None if a is None or v is None else a + v for a, v in zip(acc, layer.ys)]
        tops.append(acc)
    return tops


def _area(xs: Sequence[float], lower: Values, upper: Values, x, y, layer: Line) -> str:
    """Filled band between two series, one polygon per run of points where both exist."""
    out = []
    for run in _runs([i for i in range(len(xs)) if lower[i] is not None and upper[i] is not None]):
        top = " ".join(f"{x(xs[i]):.1f},{y(upper[i]):.1f}" for i in run)  # type: ignore[arg-type]
        bottom = " ".join(f"{x(xs[i]):.1f},{y(lower[i]):.1f}" for i in reversed(run))  # type: ignore[arg-type]
        out.append(f"<polygon points='{top} {bottom}' fill='{layer.color}' opacity='0.85'><title>{_e(layer.label)}</title></polygon>")
    return "".join(out)


def _path(xs: Sequence[float], ln: Line, x, y) -> str:
    d = []
    for run in _runs([i for i in range(len(ln.ys)) if ln.ys[i] is not None]):
        d.append("M" + " L".join(f"{x(xs[i]):.1f},{y(ln.ys[i]):.1f}" for i in run))  # type: ignore[arg-type]
    dash = " stroke-dasharray='4 3'" if ln.dashed else ""
    return f"<path d='{' '.join(d)}' stroke='{ln.color}' class='ln'{dash}><title>{_e(ln.label)}</title></path>" if d else ""


def _runs(idx: list[int]) -> list[list[int]]:
    """Consecutive index runs: a gap in the data is a gap in the plot, never a bridge."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _verdict_band(tl: Timeline, t0: float, t1: float) -> str:
    pw = W * 2 + 16 - ML - MR
    span = max(t1 - t0, 1e-9)
    cells = []
    for i, (t, v) in enumerate(zip(tl.ts, tl.verdicts)):
        start = tl.ts[i - 1] if i else t0
        x0, x1 = ML + pw * (start - t0) / span, ML + pw * (t - t0) / span
        cells.append(
            f"<rect x='{x0:.1f}' y='4' width='{max(x1 - x0, 1):.1f}' height='18' fill='{VERDICT_COLORS[v]}'>"
            f"<title>{_clock(t)}: {_e(v)}</title></rect>"
        )
    legend = " ".join(f"<span class='sw' style='background:{c}'></span>{_e(v)}" for v, c in VERDICT_COLORS.items())
    return (
        f"<svg class='band' viewBox='0 0 {W * 2 + 16} 26' width='{W * 2 + 16}' height='26' xmlns='http://www.w3.org/2000/svg'>"
        f"<text x='4' y='17' class='ax'>verdict</text>{''.join(cells)}</svg><div class='dim legend'>{legend}</div>"
    )


def _badge(verdict: str) -> str:
    return f"<span class='badge' style='background:{VERDICT_COLORS[verdict]}'>{_e(verdict)}</span>"


def _opt(arr: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else float(v) for v in arr]


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%S")


def _e(s: str) -> str:
    return html.escape(str(s), quote=True)


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:17px;margin-top:36px;border-top:1px solid #ddd;padding-top:16px}h3{font-size:14px;margin:14px 0 6px}
table{border-collapse:collapse;margin:8px 0}td,th{border-bottom:1px solid #eee;padding:4px 10px;text-align:left;vertical-align:top}
.dim{color:#777}.badge{padding:2px 8px;border-radius:4px;font-weight:600;color:#111}
.st.firing{color:#c00;font-weight:600}.st.ok{color:#2a7}.st.unknown{color:#a70}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:16px}
svg .t{font-size:12px;font-weight:600;fill:#333}svg .ax{font-size:10px;fill:#555}svg .empty{font-size:12px;fill:#999}
svg .bg{fill:#fafafa;stroke:#ddd}svg .grid{stroke:#e4e4e4}svg .ln{fill:none;stroke-width:1.6}
svg .hl{stroke-dasharray:5 3;stroke-width:1.2}svg .mark{stroke-width:1.4;stroke-dasharray:2 2}
.sw{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px;vertical-align:middle}.legend{font-size:12px;margin-bottom:8px}
ul.onsets{columns:2}
"""
