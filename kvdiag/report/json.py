"""The ``diagnose --json`` shape (also the exporter's ``/api/v1/verdicts``).

``{"instances": [{"instance", "engine", "verdict", "findings": [name], "checks": {name:
{"status", "evidence": {...}}}, "remedies": [text], ...}]}``; the extra keys (severity, alert,
reason, figures, window, notes, finding details, each check's missing fields and hint) are
additions to the documented shape, never replacements.
"""

from __future__ import annotations

import math
from typing import Iterable

from kvdiag.model import CheckResult, Diagnosis


def diagnosis_json(d: Diagnosis) -> dict:
    return {
        "instance": d.instance,
        "engine": d.engine,
        "model": d.model,
        "verdict": d.verdict.name,
        "severity": d.verdict.severity,
        "alert": d.verdict.alert,
        "exit_code": d.verdict.exit_code,
        "reason": d.verdict.reason,
        "findings": [f.name for f in d.findings],
        "finding_details": [{"name": f.name, "severity": f.severity, "alert": f.alert, "text": f.text} for f in d.findings],
        "checks": {name: check_json(c) for name, c in d.checks.items()},
        "remedies": list(d.remedies),
        "figures": dict(d.figures),
        "window": {"start": _num(d.start), "end": _num(d.end), "seconds": _num(d.end - d.start), "samples": d.samples},
        "notes": list(d.notes),
    }


def check_json(c: CheckResult) -> dict:
    ev = c.evidence
    evidence = dict(ev.values)
    evidence["summary"] = ev.summary
    if ev.sources:
        evidence["sources"] = dict(ev.sources)
    evidence["span"] = {"start": _num(ev.start), "end": _num(ev.end), "seconds": _num(ev.seconds), "samples": ev.samples}
    out: dict = {"status": c.status, "evidence": evidence}
    if c.missing:
        out["missing"] = list(c.missing)
    if c.hint:
        out["hint"] = c.hint
    return out


def report_json(diagnoses: Iterable[Diagnosis], exit_code: int) -> dict:
    return {"instances": [diagnosis_json(d) for d in diagnoses], "exit_code": exit_code}


def _num(v: float) -> float | None:
    return None if v is None or math.isnan(v) else float(v)
