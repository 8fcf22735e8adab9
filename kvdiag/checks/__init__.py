"""The checklist: every check on an instance's window, the verdict, findings and remedies.

Checks are pure functions of a ``Window`` and a ``Config``; what they are called, what they
compare against and what their answers mean is defined once in ``kvdiag.checks.catalog``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Iterable

from kvdiag.checks import evictions, l2, latency, prefix, queue, saturation
from kvdiag.checks.base import recent
from kvdiag.checks.catalog import CHECKS, EXIT_ORDER, FINDINGS, SIGNALS, VERDICTS
from kvdiag.checks.remedies import figures, remedies, reserve_figures
from kvdiag.checks.verdict import decide, findings
from kvdiag.config import Config
from kvdiag.model import CheckResult, Diagnosis, Evidence, Verdict
from kvdiag.window import Window

Evaluator = Callable[[Window, Config], CheckResult]

#: The Python evaluation of each catalog check, in catalog order.
EVALUATORS: dict[str, Evaluator] = {
    m.NAME: m.evaluate for m in (saturation, queue, evictions, latency, prefix, l2)
}
if list(EVALUATORS) != [c.name for c in CHECKS]:
    raise AssertionError("check modules and catalog disagree")

SIGNAL_CHECKS = tuple(SIGNALS.values())

log = logging.getLogger(__name__)


def run_checks(window: Window, config: Config) -> dict[str, CheckResult]:
    return {name: _sourced(evaluate(window, config), window) for name, evaluate in EVALUATORS.items()}


def _sourced(result: CheckResult, window: Window) -> CheckResult:
    """Name where each input of a check came from, as the samples' provenance says: the
    metric for scrapes, the first and last line for logs ("app.log:12 .. app.log:940")."""
    spec = next(c for c in CHECKS if c.name == result.check)
    sources = {}
    for name in spec.needs:
        first, last = window.provenance(name)
        if first is None or last is None:
            continue
        a, b = first.describe(), last.describe()
        sources[name] = a if a == b else f"{a} .. {b}"
    return replace(result, evidence=replace(result.evidence, sources=sources)) if sources else result


def diagnose(window: Window, config: Config) -> Diagnosis:
    """The full answer for one instance over the window ending at its newest sample."""
    window = recent(window, config)
    checks = run_checks(window, config)
    verdict = decide(checks, config)
    found = findings(verdict, checks)
    figs = figures(window, config)
    figs.update(reserve_figures(checks[SIGNALS["S"]], window))
    hints = [checks[c].hint for c in SIGNAL_CHECKS if checks[c].status == "unknown" and checks[c].hint]
    # a pool verdict the known signals settled while one is unknown also says how to get it
    settled = VERDICTS[verdict.name].names_pool and any(checks[c].status == "unknown" for c in SIGNAL_CHECKS)
    if (verdict.name == "unknown" or settled) and hints:
        figs["unknown_hints"] = "; ".join(dict.fromkeys(hints))
    names = list(VERDICTS[verdict.name].remedies) + [r for f in found for r in FINDINGS[f.name].remedies]
    if settled and hints:
        names.append("decide_unknown")
    last = window.last
    return Diagnosis(
        instance=window.instance,
        engine=window.engine,
        model=last.model,
        verdict=verdict,
        checks=checks,
        findings=found,
        remedies=remedies(names, window.engine, figs),
        figures=figs,
        start=window.start,
        end=window.end,
        samples=len(window),
        notes=list(dict.fromkeys(last.notes)),
        role=last.role,
    )


def diagnose_all(windows: Iterable[Window], config: Config) -> list[Diagnosis]:
    """Every instance's diagnosis. One instance's failure (a bug meeting data nobody foresaw)
    is that instance's ``unknown`` with the reason, logged once; the others are still judged."""
    out = []
    for w in windows:
        try:
            out.append(diagnose(w, config))
        except Exception as exc:  # contained per instance, as the exporter contains it per target
            log.exception("checks failed on %s", w.instance)
            out.append(undiagnosable(w.instance, f"internal error in the checks: {type(exc).__name__}: {exc}", w.end))
    return out


def undiagnosable(target: str, reason: str, ts: float) -> Diagnosis:
    """A target that served no diagnosable engine metrics (not an engine, metrics off, or an
    error): verdict unknown, the reason as its evidence and remedy."""
    checks = {
        c.name: CheckResult(c.name, "unknown", Evidence(ts, ts, 0, {}, reason), c.needs) for c in CHECKS
    }
    spec = VERDICTS["unknown"]
    verdict = Verdict("unknown", spec.severity, spec.exit_code, spec.alert, reason)
    advice = remedies(spec.remedies, "unknown", {"unknown_hints": reason})
    return Diagnosis(target, "unknown", None, verdict, checks, remedies=advice, start=ts, end=ts)


def exit_code(diagnoses: Iterable[Diagnosis]) -> int:
    """The worst verdict's exit code over instances (0 fine, 1 warning, 2 critical, 3 unknown);
    3 when there is nothing to judge."""
    codes = [d.verdict.exit_code for d in diagnoses]
    return max(codes, key=EXIT_ORDER.index) if codes else 3
