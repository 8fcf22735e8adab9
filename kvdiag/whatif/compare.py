"""How far one outcome is from another: the calibration's fit, and validate's what-if pairs.

Both questions are the same comparison: a reference (what the engine's metrics showed, or
the scenario run with the remedy applied) against a replay. Latencies, queues and evictions
are compared relatively, each against a floor below which a relative error means nothing (a
P99 TTFT under half a second is a bucket or two of the histogram); usage, a ratio already, as
a difference. A comparison is poor when the verdicts differ, the P99 TTFT is off by more than
``TOLERANCE``, or the usage by more than ``USAGE_TOLERANCE``; every error is stated either way.
Verdicts are the same as validate scores them (``refpool.validate.ACCEPTS``): the two L1
verdicts are one answer (an eviction in the last window decides which), and so are healthy and
near capacity (neither says the pool limits).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.refpool.validate import ACCEPTS
from kvdiag.whatif.replay import Outcome

TOLERANCE = 0.25  # relative P99 TTFT error a good fit and a validated prediction stay within
USAGE_TOLERANCE = 0.10  # usage difference, same
#: Below these the relative error is taken against the floor (seconds, requests, per minute).
FLOORS = {"p99_ttft": 0.5, "mean_ttft": 0.5, "waiting": 1.0, "evictions_per_min": 1.0}


def relative(reference: float | None, other: float | None, floor: float) -> float | None:
    """(other - reference) / max(reference, floor); None when either is absent."""
    if reference is None or other is None:
        return None
    return (other - reference) / max(abs(reference), floor)


@dataclass(frozen=True)
class Errors:
    """A replay against its reference, metric by metric."""

    p99_ttft: float | None  # relative
    mean_ttft: float | None  # relative
    usage: float | None  # difference
    waiting: float | None  # relative
    evictions_per_min: float | None  # relative
    same_verdict: bool
    reference_verdict: str
    verdict: str
    median_ttft: float | None = None  # relative, exact TTFTs only
    running: float | None = None  # relative

    @property
    def problems(self) -> list[str]:
        """Why the comparison is poor (empty when it is good)."""
        out = []
        if not self.same_verdict:
            out.append(f"verdict {self.verdict} against {self.reference_verdict}")
        if self.p99_ttft is None:
            out.append("no P99 TTFT to compare")
        elif abs(self.p99_ttft) > TOLERANCE:
            out.append(f"P99 TTFT off by {self.p99_ttft:+.0%} (more than {TOLERANCE:.0%})")
        if self.usage is not None and abs(self.usage) > USAGE_TOLERANCE:
            out.append(f"usage off by {self.usage:+.2f} (more than {USAGE_TOLERANCE:.2f})")
        return out

    @property
    def good(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        def pct(v: float | None) -> str:
            return "n/a" if v is None else f"{v:+.0%}"

        usage = "n/a" if self.usage is None else f"{self.usage:+.2f}"
        verdict = "same verdict" if self.same_verdict else f"verdict {self.verdict} vs {self.reference_verdict}"
        median = "" if self.median_ttft is None else f"median TTFT {pct(self.median_ttft)}, "
        running = "" if self.running is None else f"running {pct(self.running)}, "
        return (f"P99 TTFT {pct(self.p99_ttft)}, {median}mean TTFT {pct(self.mean_ttft)}, usage {usage}, {running}"
                f"waiting {pct(self.waiting)}, evictions/min {pct(self.evictions_per_min)}, {verdict}")  # fmt: skip

    def as_json(self) -> dict[str, object]:
        return {**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}, "good": self.good,
                "problems": self.problems}  # fmt: skip


def errors(reference: Outcome, replayed: Outcome, exact: bool = False) -> Errors:
    """``replayed`` against ``reference``; ``exact``: P99 TTFT from both sides' simulated
    requests (two replays), else from their histograms (a replay against an engine's metrics)."""
    p99 = "p99_ttft_sim" if exact else "p99_ttft"
    usage = None if reference.usage is None or replayed.usage is None else replayed.usage - reference.usage
    return Errors(
        p99_ttft=relative(getattr(reference, p99), getattr(replayed, p99), FLOORS["p99_ttft"]),
        mean_ttft=relative(reference.mean_ttft, replayed.mean_ttft, FLOORS["mean_ttft"]),
        usage=usage,
        waiting=relative(reference.waiting, replayed.waiting, FLOORS["waiting"]),
        evictions_per_min=relative(reference.evictions_per_min, replayed.evictions_per_min, FLOORS["evictions_per_min"]),
        same_verdict=replayed.verdict in ACCEPTS.get(reference.verdict, {reference.verdict}),
        reference_verdict=reference.verdict,
        verdict=replayed.verdict,
        median_ttft=relative(reference.median_ttft_sim, replayed.median_ttft_sim, FLOORS["mean_ttft"]) if exact else None,
        running=relative(reference.running, replayed.running, FLOORS["waiting"]),
    )
