"""The ``diagnose --json`` shape (also the exporter's ``/api/v1/verdicts``).

``{"instances": [{"instance", "engine", "verdict", "findings": [name], "checks": {name:
{"status", "evidence": {...}}}, "remedies": [text], ...}]}``; the extra keys (severity, alert,
reason, figures, window, notes, finding details, each check's missing fields and hint) are
additions to the documented shape, never replacements.

Every JSON kvdiag writes (reports, the API, recordings, generated dashboards) goes through
``dumps``: strict JSON, since browsers and most parsers reject the bare ``NaN`` / ``Infinity``
that Python's encoder writes by default.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

from kvdiag.model import CheckResult, Diagnosis


def diagnosis_json(d: Diagnosis) -> dict:
    return {
        "instance": d.instance,
        "engine": d.engine,
        "model": d.model,
        "role": d.role,
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


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that never writes ``NaN``/``Infinity``: a non-finite float becomes null.

    The common document has none, so it is encoded once, strictly; only a document that
    holds one is walked and encoded again.
    """
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(finite(obj), allow_nan=False, **kwargs)


def finite(v: Any) -> Any:
    """A copy of a JSON-able document with every non-finite float replaced by None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v
