"""The remedies hold: the ceiling counts a shared prefix once, and the admission limit never
contradicts the window it was drawn from (every scenario of the catalogue, both engines)."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kvdiag.checks import diagnose
from kvdiag.checks.remedies import Footprint, Observed, admission_limit, ceiling, figures, observed
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Scrape
from kvdiag.refpool.sim import EPOCH
from kvdiag.render import RULES_RECORDING
from kvdiag.window import Window
from tests.checks.scenario import T0, ramp, recording, window
from tests.mixin.conftest import ROOT, need
from tests.mixin.test_differential import input_series
from tests.scenario_recordings import INTERVAL, Recording

CFG = Config()


# ---------------------------------------------------------------- the arithmetic
def test_the_shared_prefix_is_subtracted_once_from_the_pool() -> None:
    fp = Footprint(prompt=1000, output=200, hit_ratio=0.7)
    assert (fp.shared, fp.private) == pytest.approx((700, 500))
    assert ceiling(40_000, fp) == (40_000 - 700) // 500 == 78
    # per request, input + output would say 33; nothing shared is that again
    assert ceiling(40_000, Footprint(1000, 200, None)) == ceiling(40_000, Footprint(1000, 200, 0.0)) == 33
    # the prefix is held once in any pool, so twice the pool holds more than twice the requests
    assert ceiling(80_000, fp) == (80_000 - 700) // 500 == 158 > 2 * 78


def test_degenerate_footprints() -> None:
    assert ceiling(500, Footprint(1000, 200, 0.7)) == 0  # the prefix alone outgrows the pool
    assert ceiling(40_000, Footprint(1000, 0, 1.0)) is None  # nothing private: the pool bounds nothing
    assert Footprint(1000, 200, 1.5).shared == 1000  # an impossible ratio never makes the private part negative


SEEN = dict(running_peak=95, pinned_at=80)


@pytest.mark.parametrize(
    ("top", "quiet", "evicted", "evictions", "limit", "says"),
    [
        (80, 90, None, 0.0, 90, ("without an eviction", "no request was evicted")),
        (80, 60, None, 0.0, 80, ("the ceiling", "no request was evicted")),
        (80, 60, 70, 12.0, 69, ("below the 70 running", "queue instead of being evicted")),
        (80, 90, 50, 12.0, 49, ("below the 50 running", "90 ran without evictions at other times")),
        (40, 30, 70, 12.0, 40, ("the ceiling", "queue instead of being evicted")),
        (80, None, None, None, 80, ("the ceiling", "no eviction counter")),
        (None, 90, None, 0.0, 90, ("without an eviction",)),
    ],
)
def test_the_limit_is_the_ceiling_held_to_the_window(
    top: int | None, quiet: int | None, evicted: int | None, evictions: float | None, limit: int, says: tuple[str, ...]
) -> None:
    got = admission_limit(top, Observed(quiet_peak=quiet, evicted_at=evicted, evictions=evictions, **SEEN))
    assert got is not None and got.value == limit
    for phrase in says:
        assert phrase in got.reason


def test_no_limit_without_a_ceiling_or_a_running_count() -> None:
    assert admission_limit(None, Observed(None, None, None, None, None)) is None
    # a pool that holds no request whole, on an idle engine: no "cap at 0"
    assert admission_limit(0, Observed(0, 0, None, None, 0.0)) is None


def test_evictions_across_a_missed_scrape_are_counted() -> None:
    """A scrape without the counter: the rise across the gap still counts as evictions."""
    w = window(recording("vllm", running=ramp(10, 1), evictions=lambda i: 3 if i == 41 else 0))
    gap = Window(w.instance, [replace(s, evictions_total=None) if i == 40 else s for i, s in enumerate(w.samples)])
    seen = observed(gap, CFG)
    assert seen.evictions == 3.0
    assert "no request was evicted" not in admission_limit(100, seen).reason  # type: ignore[union-attr]


@pytest.mark.parametrize("engine", ("sglang", "vllm"))
def test_observed_on_a_window(engine: str) -> None:
    """Running climbs 10 -> 69 over the window; two intervals evict (ending at scrapes 40 and
    50); the pool pins from scrape 30."""
    w = window(recording(engine, running=ramp(10, 1), evictions=lambda i: 1 if i in (40, 50) else 0,
                         usage=lambda i: 0.97 if i >= 30 else 0.5))  # fmt: skip
    seen = observed(w, CFG)
    assert seen == Observed(running_peak=69, quiet_peak=69, evicted_at=50, pinned_at=40, evictions=2.0)
    figs = figures(w, CFG)
    # 200,000 pool tokens; 3,000-token prompts, 80 % cached; 500-token answers
    assert (figs["shared_tokens"], figs["private_len"], figs["ceiling"]) == (2_400, 1_100, (200_000 - 2_400) // 1_100)
    assert figs["limit"] == 49 and "69 ran without evictions at other times" in str(figs["limit_reason"])
    assert figs["running_note"] == "; 69 without an eviction; requests were evicted at 50; the pool pinned at 40"


# ---------------------------------------------------------------- every scenario's windows
def _quiet_peak(history: list[PoolSample], end: float) -> int | None:
    """The most running at a scrape of the check span whose eviction counter had not moved since
    the scrape before: the test's own reading of "seen without evictions"."""
    span = [s for s in history if s.ts >= end - CFG.window]
    quiet = [b.running for a, b in zip(span, span[1:])
             if b.running is not None and a.evictions_total is not None and b.evictions_total == a.evictions_total]  # fmt: skip
    return max(quiet) if quiet else None


def _windows(rec: Recording) -> list[tuple[float, list[PoolSample]]]:
    """(t, the instance's samples up to t) for every instance at every scrape from the second."""
    by_instance: dict[str, list[PoolSample]] = {}
    out = []
    for i, body in enumerate(rec.bodies):
        for s in normalize_scrape(Scrape(EPOCH + (i + 1) * INTERVAL, "http://engine:8000", "text/plain", body), rec.engine):
            by_instance.setdefault(s.instance, []).append(s)
            if i:
                out.append(((i + 1) * INTERVAL, list(by_instance[s.instance])))
    return out


def test_no_limit_contradicts_its_window(newest_recordings: list[Recording]) -> None:
    """At every 15 s step of every scenario on both engines, the recommended admission limit is
    at least the running count the window saw without evictions, or its text says which
    evictions put it lower."""
    judged = raised = lowered = 0
    for rec in newest_recordings:
        for t, history in _windows(rec):
            figs = figures(Window(history[0].instance, history), CFG)
            quiet = _quiet_peak(history, history[-1].ts)
            if quiet is None or figs["limit"] is None:
                continue
            judged += 1
            where = f"{rec.name} at {t:.0f}s: limit {figs['limit']} ({figs['limit_reason']}), {quiet} ran without evictions"
            if int(figs["limit"]) < quiet:
                assert "evicted in the window" in str(figs["limit_reason"]), where
                lowered += 1
            raised += figs["ceiling"] is not None and quiet > int(figs["ceiling"])
    # not vacuous: windows where the data raise the ceiling and windows where evictions lower the limit
    assert judged > 500 and raised > 0 and lowered > 0, (judged, raised, lowered)


def test_the_demos_sglang_case(newest_recordings: list[Recording]) -> None:
    """The demo's SGLang story (l1-saturation): 0.70 of each prompt cached. Input + output per
    request said 31 there, and recommended cutting the running batch to it."""
    rec = next(r for r in newest_recordings if r.name.startswith("l1-saturation sglang"))
    _, history = _windows(rec)[-1]
    d = diagnose(Window(history[0].instance, history), CFG)
    figs, text = d.figures, "\n".join(d.remedies)
    quiet = _quiet_peak(history, history[-1].ts)
    naive = int(figs["pool_tokens"]) // int(figs["avg_len"])  # what input + output per request says
    assert d.verdict.name in ("l1_kv_bottleneck", "l1_kv_pressure") and quiet is not None and quiet > naive
    assert float(figs["hit_ratio"]) > 0.6 and int(figs["ceiling"]) >= 2 * naive
    assert int(figs["limit"]) > naive and f"--max-running-requests {figs['limit']}," in text
    assert int(figs["limit"]) >= quiet or "evicted in the window" in str(figs["limit_reason"])
    assert f"--max-running-requests {naive}," not in text and "shared prefix tokens, held once" in text


def test_the_issues_case() -> None:
    """As measured: a 38,871-token pool, ~1,100-token prompts 0.70 cached, ~150-token answers
    (1,253 per request), 90 running and no eviction. Input + output said 31."""
    fp = Footprint(1_103, 150, 0.70)
    assert 38_871 // (fp.prompt + fp.output) == 31
    assert ceiling(38_871, fp) == 79
    limit = admission_limit(79, Observed(running_peak=90, quiet_peak=90, evicted_at=None, pinned_at=None, evictions=0.0))
    assert limit is not None and limit.value == 90 and "no request was evicted" in limit.reason


# ---------------------------------------------------------------- the rule is the figure
def recorded(tmp_path: Path, cases: list[tuple[str, str, list[Scrape], str, float]]) -> None:
    """Each (engine, name, scrapes, PromQL, value): the committed recording rules, run by
    promtool over the scrapes, give ``value`` for the expression at the last scrape."""
    promtool = need("promtool")
    groups = []
    for engine, name, scrapes, expr, value in cases:
        rec = Recording(name, engine, "", tuple(s.body for s in scrapes))
        groups.append({
            "name": name,
            "interval": f"{int(scrapes[1].ts - scrapes[0].ts)}s",
            "input_series": input_series(rec, {"job": "kvdiag-figures", "instance": "engine:8000"}),
            "promql_expr_test": [{"expr": expr, "eval_time": f"{int(scrapes[-1].ts - T0)}s",
                                  "exp_samples": [{"labels": "{}", "value": value}]}],
        })  # fmt: skip
    path = tmp_path / "figures.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [str(ROOT / RULES_RECORDING)], "evaluation_interval": "5s", "tests": groups}))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_recorded_ceiling_is_the_python_ceiling(tmp_path: Path) -> None:
    """``instance:kvdiag_concurrency_ceiling:requests5m`` (the dashboards' ceiling) equals the
    remedies' (a shared prefix on one engine, none on the other; a minute of scrapes each)."""
    cases = []
    for engine, hit in (("sglang", 0.8), ("vllm", 0.0)):
        scrapes = recording(engine, steps=12, hit=hit)
        top = figures(window(scrapes), CFG)["ceiling"]
        assert top == (200_000 - 3_000 * hit) // (3_000 * (1 - hit) + 500)
        cases.append((engine, f"{engine} hit {hit}", scrapes, "max(instance:kvdiag_concurrency_ceiling:requests5m)", float(top)))
    recorded(tmp_path, cases)
