"""What ``kvdiag whatif`` shows: the fit, the calibration against the incident, each remedy.

The same ``WhatIf`` record renders three ways: terminal tables (``Fitted``, so no name is cut
at 80 columns), JSON, and a section of the HTML report. The calibration's errors are always
shown, and a poor fit says so in words beside the predictions it weakens.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from kvdiag.report.terminal import Fitted
from kvdiag.whatif.compare import TOLERANCE, Errors, errors
from kvdiag.whatif.fit import Fit
from kvdiag.whatif.replay import Outcome, Run


@dataclass
class WhatIf:
    """One instance: its fit, what its metrics showed, the calibration replay and the remedies."""

    fit: Fit
    observed: Outcome
    calibration: Run
    remedies: list[Run] = field(default_factory=list)
    full_calibration: Run | None = None  # with a scale model: the calibration at full size
    #: With a scale model checked on the window's first minutes only: the model's calibration
    #: over the same span, which ``full_calibration`` is compared with (None: the whole window).
    scaled_check: Run | None = None

    @property
    def scale_errors(self) -> Errors | None:
        """The scale model's calibration against the full-size one over the same span (both
        simulated: exact P99s)."""
        model_run = self.scaled_check or self.calibration
        full, model = (self.full_calibration.outcome if self.full_calibration else None), model_run.outcome
        return None if full is None or model is None else errors(full, model, exact=True)

    def scale_line(self) -> str:
        """What the scale model costs in accuracy on this window ("" at full size)."""
        if self.full_calibration is None:
            return ""
        e = self.scale_errors
        model_run = self.scaled_check or self.calibration
        k = f"1/{model_run.scale:g}"
        if e is None:
            return f"scale model {k}: its error could not be measured ({self.full_calibration.error or model_run.error})"
        span = "" if model_run.first_s is None else f" over the window's first {model_run.first_s / 60:g} min"
        return (f"scale model {k}: {'within' if e.good else 'NOT within'} the goal against the full-size calibration{span} "
                f"({e.describe()}; {self.full_calibration.wall_s:.0f}s at full size, {model_run.wall_s:.0f}s at {k})")  # fmt: skip

    @property
    def fit_errors(self) -> Errors | None:
        out = self.calibration.outcome
        return None if out is None else errors(self.observed, out)

    def quality(self) -> str:
        """The fit-quality line: every error, and whether the fit is good enough to trust."""
        e = self.fit_errors
        if e is None:
            return f"fit: the calibration replay failed ({self.calibration.error}); no prediction can be trusted"
        if e.good:
            return f"fit: good (replayed vs observed: {e.describe()})"
        return f"fit: POOR ({'; '.join(e.problems)}), so predictions are rough (replayed vs observed: {e.describe()})"

    def as_json(self) -> dict[str, object]:
        e = self.fit_errors
        return {
            "fit": self.fit.as_json(),
            "observed": self.observed.as_json(),
            "calibration": _run_json(self.calibration),
            "fit_errors": None if e is None else e.as_json(),
            "fit_quality": self.quality(),
            "full_calibration": None if self.full_calibration is None else _run_json(self.full_calibration),
            "scaled_check": None if self.scaled_check is None else _run_json(self.scaled_check),
            "scale_errors": None if self.scale_errors is None else self.scale_errors.as_json(),
            "scale_model": self.scale_line() or None,
            "remedies": [_run_json(r) | {"why": r.lever.why if r.lever else "", "flag": r.lever.flag(self.fit.engine) if r.lever else ""}
                         for r in self.remedies],  # fmt: skip
        }


def _run_json(r: Run) -> dict[str, object]:
    return {"remedy": r.label, "outcome": None if r.outcome is None else r.outcome.as_json(), "error": r.error or None,
            "wall_s": round(r.wall_s, 2)}  # fmt: skip


# ---------------------------------------------------------------- cells
def _s(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.2f}s" if v < 10 else f"{v:,.0f}s"


def _n(v: float | None, spec: str = ",.1f") -> str:
    return "—" if v is None else format(v, spec)


def _cells(o: Outcome | None) -> list[str]:
    """P99 TTFT, mean TTFT, usage, waiting, evictions/min, throughput, verdict."""
    if o is None:
        return ["—"] * 7
    usage = "—" if o.usage is None else f"{o.usage:.2f}"
    return [_s(o.p99_ttft), _s(o.mean_ttft), usage, _n(o.waiting), _n(o.evictions_per_min), _n(o.throughput, ",.0f"), o.verdict]


HEADERS = ("P99 TTFT", "mean TTFT", "usage", "waiting", "evictions/min", "tokens/s", "verdict")


def _table(w: WhatIf) -> Table:
    title = f"what if: {w.fit.instance} ({w.fit.engine}), replayed through the reference engine"
    table = Table(title=title, show_lines=False)
    table.add_column("run", no_wrap=True)
    for h in HEADERS:
        table.add_column(h, no_wrap=True, justify="left" if h == "verdict" else "right")
    table.add_column("lever", overflow="fold")
    table.add_row("observed", *_cells(w.observed), "the incident's own metrics")
    table.add_row(w.calibration.label, *_cells(w.calibration.outcome), w.calibration.error or "the fit, as observed")
    for r in w.remedies:
        flag = r.lever.flag(w.fit.engine) if r.lever else ""
        note = r.error or "; ".join(x for x in (r.lever.why if r.lever else "", f"engine flag {flag}" if flag else "") if x)
        table.add_row(r.label, *_cells(r.outcome), note)
    return table


def render(console: Console, results: list[WhatIf]) -> None:
    for w in results:
        f = w.fit
        console.print(
            f"[bold]{f.instance}[/bold]: {f.duration:,.0f}s window, {f.rate:.2f} req/s on average (peak "
            f"{max(f.arrivals.rates, default=0.0):.2f}), prompt {f.prompt_tokens:,.0f} / output {f.output_tokens:,.0f} "
            f"tokens per request, pool {f.pool_tokens:,} tokens",
            highlight=False,
        )
        knobs = Table(title="fitted knobs", show_header=True)
        for col in ("knob", "value", "basis", "from"):
            knobs.add_column(col, no_wrap=col != "from", overflow="fold")
        for k in f.knobs:
            knobs.add_row(k.name, k.value, k.basis, k.note)
        console.print(Fitted(knobs, drop=("from",)))
        console.print(Fitted(_table(w), drop=("lever", "mean TTFT", "tokens/s")))
        console.print(w.quality(), style="red" if w.fit_errors is None or not w.fit_errors.good else "green", highlight=False)
        if f.step is not None:
            console.print(f"step time: {f.step.describe()}", highlight=False)
        if w.scale_line():
            console.print(w.scale_line(), style="green" if w.scale_errors and w.scale_errors.good else "red", highlight=False)
        assumed = ", ".join(k.name for k in f.assumed)
        if assumed:
            console.print(f"assumed (not in the series): {assumed}", style="dim", highlight=False)
        console.print()


def html_section(w: WhatIf) -> str:
    """The what-if section of an instance in the HTML report."""
    e = html.escape
    rows = [("observed", w.observed, "the incident's own metrics"), (w.calibration.label, w.calibration.outcome, w.calibration.error)]
    rows += [(r.label, r.outcome, r.error or (r.lever.why if r.lever else "")) for r in w.remedies]
    body = "".join(
        "<tr>" + "".join(f"<td>{e(c)}</td>" for c in (label, *_cells(o), note)) + "</tr>" for label, o, note in rows
    )
    knobs = "".join(f"<tr><td>{e(k.name)}</td><td>{e(k.value)}</td><td>{e(k.basis)}</td><td class='dim'>{e(k.note)}</td></tr>"
                    for k in w.fit.knobs)  # fmt: skip
    good = w.fit_errors is not None and w.fit_errors.good
    return (
        "<h3>what if: the window replayed through the reference engine under each remedy</h3>"
        f"<p class='{'' if good else 'st firing'}'>{e(w.quality())}</p>"
        + (f"<p>{e(w.scale_line())}</p>" if w.scale_line() else "")
        + (f"<p>step time: {e(w.fit.step.describe())}</p>" if w.fit.step is not None else "")
        + f"<table class='whatif'><tr>{''.join(f'<th>{e(h)}</th>' for h in ('run', *HEADERS, 'lever'))}</tr>{body}</table>"
        f"<details><summary>fitted knobs (P99 TTFT tolerance {TOLERANCE:.0%})</summary><table class='knobs'>"
        f"<tr><th>knob</th><th>value</th><th>basis</th><th>from</th></tr>{knobs}</table></details>"
    )
