"""`kvdiag validate`: the ground-truth rule, the instant-by-instant scoring, the JSON contract,
the progress display and the exit code, and the checklist scored on the whole scenario
catalogue on both engines."""

from __future__ import annotations

import json
import re

import pytest

from kvdiag.cli import main
from kvdiag.config import Config
from kvdiag.refpool.scenarios import SCENARIOS
from kvdiag.refpool.validate import (
    GRACE_S, L1_VERDICTS, SCORED_FROM_S, TRUTH_SPAN_S, Instant, Report, Result, SpanTruth, Truth, _label, score, validate,
)

KEYS = {"name", "engine", "expected", "verdict", "correct", "detection_delay_s", "slo_breach_s", "onset_s",
        "first_l1_s", "slo_breach_at_s", "named_before_breach", "instants", "truth_l1_from_s"}  # fmt: skip


@pytest.mark.parametrize(
    ("l1_binds", "backlog", "recompute", "full", "label"),
    [
        (True, True, True, False, "l1_kv_bottleneck"),
        (True, True, False, True, "l1_kv_pressure"),
        (True, False, True, True, "l1_kv_pressure"),
        (True, False, False, True, "near_kv_capacity"),
        (False, True, True, False, "l1_kv_pressure"),
        (False, True, False, True, "queue_without_kv_pressure"),
        (False, False, True, True, "near_kv_capacity"),
        (False, False, True, False, "healthy"),
        (False, False, False, False, "healthy"),
    ],
)
def test_truth_rule(l1_binds: bool, backlog: bool, recompute: bool, full: bool, label: str) -> None:
    assert _label(l1_binds, backlog, recompute, full) == label


class Scripted:
    """A truth reader whose label changes at set times (the simulator's log, reduced to labels)."""

    def __init__(self, changes: list[tuple[float, str]]) -> None:
        self.changes = changes

    def span(self, start: float, end: float) -> SpanTruth:
        label = [lab for t, lab in self.changes if t <= end][-1]
        return SpanTruth(label, label.startswith("l1_"), 0.0, 0, False, 0.0)


def test_scoring_grace_misleading_and_false_alarms() -> None:
    """Healthy until 150 s, then L1 binds. Scored from the first minute, except the grace after
    the change and the truth span before it; a late L1 verdict inside the grace costs nothing,
    outside it is misleading; an L1 verdict while healthy is a false alarm."""
    reader = Scripted([(0.0, "healthy"), (150.0, "l1_kv_pressure"), (260.0, "l1_kv_bottleneck")])
    verdicts = {t: "healthy" if t < 170 or t == 240 else "l1_kv_bottleneck" for t in range(5, 305, 5)}
    verdicts[90] = "l1_kv_pressure"
    instants = score(reader, [(float(t), v) for t, v in verdicts.items()])  # type: ignore[arg-type]
    by_t = {i.t: i for i in instants}
    assert not any(i.scored for i in instants if i.t < SCORED_FROM_S)
    assert not by_t[150 - TRUTH_SPAN_S].scored and not by_t[150 + GRACE_S - 5].scored and by_t[150 + GRACE_S].scored
    assert by_t[150 - TRUTH_SPAN_S - 5].scored
    assert by_t[90].false_alarm and not by_t[90].right
    assert by_t[240].misleading and not by_t[240].right
    assert by_t[265].scored and by_t[265].right  # pressure -> bottleneck changes no accepted verdict: no grace
    assert [i.t for i in instants if i.scored and not i.right] == [90.0, 240.0]


@pytest.fixture(scope="module")
def report() -> Report:
    """The whole catalogue on both engines, once, two runs at a time (about a minute of CPU)."""
    return validate(config=Config(), jobs=2)


def result(report: Report, name: str, engine: str) -> Result:
    return next(r for r in report.results if r.name == name and r.engine == engine)


def test_every_scenario_tells_its_story_and_every_verdict_is_right(report: Report) -> None:
    """The label the simulator's ground truth implies is the one each scenario was built for (so a
    scenario cannot silently stop telling its story), and the checklist names it."""
    for r in report.results:
        scenario, _, rank = r.name.partition("/dp")
        intent = SCENARIOS[scenario].intent_for(r.engine)[int(rank or 0)]
        told = r.expected in L1_VERDICTS if intent in L1_VERDICTS else r.expected == intent
        assert told, (r.name, r.engine, intent, r.truth)
    wrong = [(r.name, r.engine, r.expected, r.verdict) for r in report.results if not r.correct]
    assert not wrong and report.correct == len(report.results) == 34


def test_every_scored_instant_is_right(report: Report) -> None:
    """At every scrape after the first minute (outside the grace), the verdict is one the truth at
    that instant accepts: no misleading and no false-alarm instant, and most instants scored."""
    wrong = {(r.name, r.engine): [(i.t, i.truth, i.verdict) for i in r.scored if not i.right] for r in report.results}
    assert not any(wrong.values()), {k: v for k, v in wrong.items() if v}
    assert report.misleading == report.false_alarms == 0 and report.ok
    for r in report.results:
        assert len(r.scored) >= 0.25 * len(r.instants), (r.name, r.engine, len(r.scored), len(r.instants))


def test_l1_is_named_before_the_slo_breach_in_every_l1_scenario(report: Report) -> None:
    l1 = [r for r in report.results if r.truth.onset is not None]
    assert len(l1) == 17  # the final truth is L1 (recovery ends healthy)
    # closed loops start overloaded: the SLO breaks ~20 s in, before the checks hold a window
    # (nothing is scored before SCORED_FROM_S); those are named within that first minute
    ramps = [r for r in l1 if r.truth.onset >= SCORED_FROM_S / 2]
    late = [(r.name, r.engine, r.detected, r.truth.slo_breach) for r in ramps if not r.named_before_breach]
    assert not late
    cold = [r for r in l1 if r not in ramps]
    assert {r.name for r in cold} == {"closed-loop", "eos-answers"}
    assert all((d := r.since_onset(r.detected)) is not None and d <= SCORED_FROM_S for r in cold), [
        (r.name, r.engine, r.since_onset(r.detected)) for r in cold]
    fast = [r for r in l1 if r.name == "ramp-fast"]
    for r in fast:  # the flash crowd breaches the SLO within 20 s of the pool pinning
        delay, breach = r.since_onset(r.detected), r.since_onset(r.truth.slo_breach)
        assert delay is not None and breach is not None and 0 <= delay < breach <= 20, (r.engine, delay, breach)


def test_sglang_saturation_is_named_l1_by_admission_usage(report: Report) -> None:
    """SGLang's admission reserve keeps token_usage below 1 while admission is blocked on KV: the
    usage gauge is not pinned, admission usage is, and the short window names L1 within half a
    minute of the onset. The long answers' decode growth outruns the reserve again and again, so
    it retracts more than once (the demo's story)."""
    r = result(report, "l1-saturation", "sglang")
    assert r.expected == r.verdict == "l1_kv_bottleneck"
    assert r.truth.kv_blocked_share > 0.8 and r.truth.evictions >= 2 and r.truth.onset is not None
    delay = r.since_onset(r.detected)
    assert delay is not None and 0 <= delay <= 30


def test_vllm_saturation_without_preemptions_is_named_l1_by_the_room_a_step_frees(report: Report) -> None:
    """vLLM reads its usage gauge after a step's finished requests free their blocks; with 5-token
    answers a step frees a fifth of the pool, which the next admission refills at once. Admission
    is blocked on KV at most steps with no preemption at all while the gauge reads far below 0.95:
    admission usage (the gauge plus the room one step frees) names L1, before the SLO breach."""
    r = result(report, "short-answers", "vllm")
    assert r.truth.kv_blocked_share > 0.8 and r.truth.evictions == 0 and r.truth.onset is not None
    assert r.expected == r.verdict == "l1_kv_pressure" and r.named_before_breach
    assert all(i.right for i in r.scored)


def test_json_progress_lines_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", "--json", "--jobs", "1", "--scenario", "sequence-cap", "--scenario", "noisy-healthy"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert set(out) == {"scenarios", "correct", "total", "instants", "scoring", "ok"}
    assert out["total"] == 4 and out["correct"] == 4 and out["ok"] is True and code == 0
    assert out["scoring"] == {"scored_from_s": SCORED_FROM_S, "truth_span_s": TRUTH_SPAN_S, "grace_s": GRACE_S}
    assert out["instants"]["misleading"] == out["instants"]["false_alarms"] == 0
    for row in out["scenarios"]:
        assert set(row) == KEYS and row["correct"] is True
        assert row["detection_delay_s"] is None and row["named_before_breach"] is None  # no L1 onset
        assert row["instants"]["scored"] > 30 and row["instants"]["right"] == row["instants"]["scored"]
    # piped: one plain line per finished run on stderr, no terminal control codes
    lines = captured.err.strip().splitlines()
    assert lines == [
        "validate [1/4] sequence-cap on sglang: ok", "validate [2/4] sequence-cap on vllm: ok",
        "validate [3/4] noisy-healthy on sglang: ok", "validate [4/4] noisy-healthy on vllm: ok",
    ]  # fmt: skip


def test_misleading_instants_exit_non_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """Checks that cannot see a pinned pool (usage must reach 1.0 at every sample, and a queue must
    grow by 10,000) call the seed's saturation a queue or healthy: misleading instants, exit 1."""
    args = ["validate", "--json", "--jobs", "1", "--scenario", "l1-saturation", "--engine", "sglang",
            "--set", "saturated_usage=1", "--set", "saturated_fraction=1", "--set", "queue_min_growth=10000"]  # fmt: skip
    assert main(args) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["instants"]["misleading"] > 10


def test_progress_bar_on_a_terminal() -> None:
    """On a terminal, validate draws a rich progress bar (on stderr) instead of plain lines."""
    import os
    import pty
    import subprocess
    import sys

    main_fd, child_fd = pty.openpty()
    cmd = [sys.executable, "-m", "kvdiag", "validate", "--scenario", "noisy-healthy", "--engine", "vllm", "--jobs", "1"]
    proc = subprocess.Popen(cmd, stdin=child_fd, stdout=child_fd, stderr=child_fd, env={**os.environ, "COLUMNS": "120"})
    os.close(child_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(main_fd)
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))  # colours, cursor moves
    assert "━" in out and "0/1" in out and "1/1" in out  # the bar and its count, before and after the run
    assert "validate [1/1]" not in out  # not the piped display
    assert "final verdicts right" in out


def test_the_truth_names_l1_from_the_first_instant_it_holds_at_half_of_those_after() -> None:
    """``Result.l1_from``: a lone L1 label before the pool limits for good is not where it
    began; where L1 never holds at half of the instants after any, there is none."""
    def result(labels: str) -> Result:
        instants = tuple(Instant(5.0 * k, "l1_kv_pressure" if c == "L" else "near_kv_capacity", c == "L", "healthy", True)
                         for k, c in enumerate(labels))  # fmt: skip
        return Result("s", "e", "l1_kv_pressure", "healthy", Truth("l1_kv_pressure", 1.0, 0, True, 0.0, 0.0, None), None, None, 0.0, instants)

    assert result("..L......LLL.LL").l1_from == 45.0
    assert result("LLLL").l1_from == 0.0
    assert result("L....").l1_from is None and result("....").l1_from is None
