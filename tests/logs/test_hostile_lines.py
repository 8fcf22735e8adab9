"""Issue 30, item 3: every log grammar reads a line in time linear in its length, and no line
of any shape is a traceback (a fuzz target over the line grammar).

Linearity is tested without timing anything: each adversarial line is about a megabyte, which a
linear grammar reads in well under a second and a quadratic one (like the retract grammar
this replaced: 5 s at 28 KB) in hours; the lines are read in a child process whose timeout is
only a hang guard, sized for a machine ten times slower than this one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiag.sources.logformats import LogLine, Mention, parse

HANG_GUARD_S = 300
SGL = "[2026-11-29 11:33:15] "
VLL = "(APIServer pid=1) INFO 11-29 11:33:15 [loggers.py:1] "
RETRACT = "KV cache pool is full. Retract requests. #retracted_reqs: 1"
DECODE = "Decode batch, #running-req: 1, #token: 5, token usage: 0.10, "
PREFILL = "Prefill batch, #new-seq: 1, #new-token: 1, #cached-token: 0, token usage: 0.10, #running-req: 1, #queue-req: 0"
VSTATS = "Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 1.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, "

#: (name, head, repeated unit, tail): the unit repeated N times between head and tail, the tail
#: making the line fail at its very end (the worst case for a backtracking grammar).
ADVERSARIAL = [
    ("retract (the issue's line)", SGL + RETRACT, ", #a: 1", ", #x"),
    ("retract with ratios", SGL + RETRACT, ", #new_token_ratio: 0.5000 -> 0.3000, #a: 1", ", #x"),
    ("decode middle fields", SGL + DECODE, "a: b, ", "x"),
    ("decode tail fields", SGL + DECODE + "gen throughput (token/s): 1.0, #queue-req: 0", ", a: b", ", x"),
    ("prefill tail fields", SGL + PREFILL, ", a: b", ", x"),
    ("vllm middle fields", VLL + VSTATS, "a, ", "x"),
    ("vllm preemptions", VLL + VSTATS, "Preemptions: 1, ", "x"),
    ("vllm tail fields", VLL + VSTATS + "GPU KV cache usage: 1.0%", ", a: b", ", x"),
    ("vllm prefix levels", "", "INFO 11-29 ", "Avg prompt throughput: x"),
    ("sglang rank tags", "[2026-11-29 11:33:15", " TP1", "x] Decode batch"),
    ("logo", "", "█ ▀▄▀ █", " version x"),
    ("compose prefix", "", "a", "  | Decode batch"),
]
REPEATS = 100_000


def test_every_grammar_reads_a_megabyte_line_in_linear_time(tmp_path: Path) -> None:
    script = tmp_path / "adversarial.py"
    script.write_text(
        "import json, sys\n"
        "from kvdiag.sources.logformats import parse\n"
        "cases = json.loads(sys.stdin.read())\n"
        "for name, head, unit, tail in cases:\n"
        f"    line = head + unit * {REPEATS} + tail\n"
        "    got = parse(line)\n"
        "    print(name, type(got).__name__, getattr(got, 'fields', None) is None, flush=True)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], input=json.dumps(ADVERSARIAL), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(ADVERSARIAL)
    assert lines[0] == "retract (the issue's line) LogLine True"  # read, and refused as no retract line


def test_inspect_log_reads_the_issues_retract_line(tmp_path: Path) -> None:
    """The reproduction: a ``... #retracted_reqs: 1`` line with ``, #a: 1`` x 4,000 and ``, #x``
    (here x 140,000, a megabyte), among good lines that must still count."""
    decode = "Decode batch, #running-req: 40, #token: 9000, token usage: 0.90, gen throughput (token/s): 100.00, #queue-req: 3"
    log = tmp_path / "server.log"
    log.write_text(
        f"[2026-11-29 11:33:15] {decode}\n"
        f"[2026-11-29 11:33:16] {RETRACT}" + ", #a: 1" * 140_000 + ", #x\n"
        f"[2026-11-29 11:33:17] KV cache pool is full. Retract requests. #retracted_reqs: 4, #new_token_ratio: 0.7000 -> 0.5000\n"
        f"[2026-11-29 11:33:18] {decode}\n"
    )
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "inspect", "--log", str(log), "--json", "--log-year", "2026"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "server.log:2: SGLang retract warning: does not match the SGLang retract warning grammar" in proc.stderr
    (inst,) = json.loads(proc.stdout)["instances"]
    assert inst["evictions_total"] == 4 and inst["running"] == 40


def test_the_retract_grammar_reads_what_it_read_before() -> None:
    for line, retracted, ratio in [
        (SGL + RETRACT, "1", None),
        (SGL + RETRACT + ", #new_token_ratio: 0.7000 -> 0.5000", "1", "0.5000"),
        (SGL + RETRACT + ", #a: 2, #new_token_ratio: 0.7000 -> 0.5000, #b: 3, ", "1", "0.5000"),
        (SGL + "Decode out of memory happened. #retracted_reqs: 4, #new_token_ratio: 0.3000 -> 0.4000", "4", "0.4000"),
    ]:
        got = parse(line)
        assert isinstance(got, LogLine) and got.fields is not None, line
        assert got.fields["retracted"] == retracted and got.fields["new_ratio"] == ratio


# --- fuzz target: the line grammar ----------------------------------------------------------

#: Pieces real lines are made of, so that generated lines reach deep into every grammar.
PIECES = [
    SGL, VLL, "[2026-11-29 11:33:15 DP1 TP0] ", "[pod/x/y] ", "svc-1  | ", "2026-11-29T11:33:15.123Z ",
    "Nov 29 11:33:15 host sglang[12]: ", RETRACT, DECODE, PREFILL, VSTATS, "Decode batch", "Prefill batch",
    "#running-req: ", "#queue-req: ", "#token: ", "token usage: ", "full token usage: ", ", ", ": ", "#", "1", "0.50",
    "nan", "inf", "-> ", "GPU KV cache usage: ", "Prefix cache hit rate: ", "%", "Preemptions: ", "reqs", "\x1b[32m",
    "\x1b[0m", "█ ▀▄▀ █ version 0.11.1", "Initializing a V1 LLM engine (v", "Engine 001: ", "\r", "\t", "\u00e9", "\x00",
]  # fmt: skip


@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=30))
def test_fuzz_log_lines(pieces: list[str]) -> None:
    """Any line: a LogLine with fields that are numbers where numbers are read, a Mention, or
    None; never an exception."""
    got = parse("".join(pieces))
    assert got is None or isinstance(got, (LogLine, Mention))
    if isinstance(got, LogLine) and got.fields is not None:
        for key in ("running", "queue", "retracted", "waiting", "token"):
            value = got.fields.get(key)
            assert value is None or value.isdigit(), (key, value)
