"""Remedies with numbers: the concurrency ceiling and what each lever buys at observed lengths.

The ceiling is pool tokens / average sequence length (input + output tokens per finished
request, from the engine's token and request counters over the window; over the engine's
lifetime when nothing finished in the window). Knob names come from the engine's adapter;
the texts come from the catalog.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Iterable

from kvdiag import engines
from kvdiag.checks.base import per_request, span
from kvdiag.checks.catalog import REMEDIES
from kvdiag.config import Config
from kvdiag.window import Window

Figures = dict[str, float | int | str | None]


def figures(window: Window, config: Config) -> Figures:
    """Pool tokens, tokens per request, the ceiling, the running count, and what FP8 / twice
    the L1 would make of the ceiling. Absent inputs leave their figures None."""
    cap = window.last.capacity_tokens
    avg, basis = _avg_len(window, config)
    _, running = span(window, config, "running")
    ceiling = int(cap // avg) if cap and avg else None
    return {
        "pool_tokens": int(cap) if cap else None,
        "avg_len": int(round(avg)) if avg else None,
        "avg_len_basis": basis,
        "ceiling": ceiling,
        "running_peak": int(running.max()) if len(running) else None,
        "running_mean": float(running.mean()) if len(running) else None,
        "fp8_pool_tokens": int(cap * 2) if cap else None,
        "fp8_ceiling": int(2 * cap // avg) if cap and avg else None,
        "double_ceiling": 2 * ceiling if ceiling is not None else None,
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


def _avg_len(window: Window, config: Config) -> tuple[float | None, str]:
    prompt, prompt_basis = per_request(window, config, "prompt_tokens_total")
    output, output_basis = per_request(window, config, "generation_tokens_total")
    total = (prompt or 0.0) + (output or 0.0)
    if not total:
        return None, "unknown"
    return total, prompt_basis if prompt is not None else output_basis
