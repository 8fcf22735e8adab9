"""A synthetic fleet made of real engine expositions, for the rules at fleet scale.

Built from the project's real engine expositions (``../shared/fixtures``: a vLLM 0.33.0 and an
SGLang 0.5.23 server at mid load, read in place), half of each. Every instance replays a
saturation story at its own phase offset (``PHASES`` per engine, so any fleet of a multiple of
``2 * PHASES`` instances holds the same mix): the load ramps from 0.2 to 1.4 of the pool and back
over ``PERIOD`` steps, so usage pins, the queue grows, requests are preempted / retracted and
first tokens slow past the SLO; or, ``steady``, every instance stays at its phase's load while
its counters keep counting (verdicts that hold still, for tests). Counters start at the
fixture's values and only grow, across loops too. Instances at the same step share one body.

``bench/bench_rules.py`` serves it to a Prometheus at 1,000 and 10,000 instances;
``test_fleet.py`` serves tens of instances to a real Prometheus and to the Python checks.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from tests.conftest import shared_fixture

FIXTURES = {"vllm": "vllm-0.33.0-midload.prom", "sglang": "sglang-0.5.23-midload.prom"}
PERIOD = 160  # story steps (one scrape interval each): 40 minutes at 15 s
PHASES = 20  # phase offsets per engine
#: the story's gauges and counters, by family (both engines)
USAGE = {"sglang:token_usage", "sglang:full_token_usage", "vllm:kv_cache_usage_perc"}
WAITING = {"sglang:num_queue_reqs", "vllm:num_requests_waiting"}
EVICTIONS = {"sglang:num_retracted_requests_total", "vllm:num_preemptions_total"}
TTFT = {"sglang:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"}
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")


def load(step: int) -> float:
    """The story's load at a step: a triangle from 0.2 to 1.4 and back over ``PERIOD``."""
    u = (step % PERIOD) / PERIOD
    return 0.2 + 1.2 * (1 - abs(2 * u - 1))


@dataclass
class Line:
    """One sample line: its text up to the value, and its value at every step of a period
    (a gauge) or its increase at every step (a counter, whose value is base + what it gained)."""

    prefix: str
    base: float
    per_step: list[float]
    counter: bool

    def __post_init__(self) -> None:
        self.cumulative = [0.0] * PERIOD
        total = 0.0
        for i, v in enumerate(self.per_step):
            total += v
            self.cumulative[i] = total
        self.period_total = total

    def value(self, step: int) -> float:
        if not self.counter:
            return self.per_step[step % PERIOD]
        return self.base + (step // PERIOD) * self.period_total + self.cumulative[step % PERIOD]


def _family(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def exposition(engine: str, keep: re.Pattern | None, loads: list[float]) -> list[Line | str]:
    """The fixture of ``engine`` as story lines at ``loads`` (one per step of a period;
    ``keep``: only the sample names it matches)."""
    text = shared_fixture(FIXTURES[engine]).read_text()
    lines: list[Line | str] = []
    hist_count: dict[tuple[str, str], float] = {}
    for raw in text.splitlines():
        m = SAMPLE.match(raw)
        if m and m.group(1).endswith("_count"):
            hist_count[(_family(m.group(1)), re.sub(r',?le="[^"]*"', "", m.group(2) or ""))] = float(m.group(3))
    busy = [min(x, 1.0) for x in loads]
    for raw in text.splitlines():
        if raw.startswith("#"):
            fam = (raw.split() + ["", "", ""])[2]
            if keep is None or any(keep.fullmatch(fam + s) for s in ("", "_total", "_bucket", "_count", "_sum")):
                lines.append(raw + "\n")
            continue
        m = SAMPLE.match(raw)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if keep is not None and not keep.fullmatch(name):
            continue
        fam, prefix = _family(name), f"{name}{labels} "
        if name in USAGE:
            lines.append(Line(prefix, 0.0, [min(0.995, 0.3 + 0.7 * x) for x in loads], False))
        elif name in WAITING:
            lines.append(Line(prefix, 0.0, [float(round(max(0.0, 150 * (x - 1)))) for x in loads], False))
        elif name in EVICTIONS:
            lines.append(Line(prefix, value, [2.0 if x > 1.05 else 0.0 for x in loads], True))
        elif fam in TTFT and name[len(fam):] in ("_bucket", "_count", "_sum"):
            count = hist_count.get((fam, re.sub(r',?le="[^"]*"', "", labels)), 0.0)
            rate = count / 240  # the fixture's observations as one hour at full load
            le = re.search(r'le="([^"]*)"', labels)
            if name.endswith("_bucket") and le:
                bound = float(le.group(1))
                normal = 1.0 if bound >= 1 else (value / count if count else 1.0)  # under load: within 1 s
                slow = 1.0 if bound >= 20 else 0.0  # overloaded: every first token 10-20 s
                per = [rate * b * (slow if x > 1 else normal) for x, b in zip(loads, busy)]
            elif name.endswith("_count"):
                per = [rate * b for b in busy]
            else:
                mean = value / count if count else 0.0
                per = [rate * b * (15.0 if x > 1 else min(mean, 0.5)) for x, b in zip(loads, busy)]
            lines.append(Line(prefix, value, per, True))
        elif name.endswith(("_total", "_bucket", "_count", "_sum")) and not name.endswith("_created"):
            lines.append(Line(prefix, value, [value / 240 * b for b in busy], True))
        else:
            lines.append(Line(prefix, 0.0, [value] * PERIOD, False))
    return lines


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
    return repr(float(v)) if v != int(v) or abs(v) >= 1e15 else str(int(v))


class Fleet:
    """Bodies by (engine, phase or step), built once and shared by the instances there."""

    def __init__(self, keep: re.Pattern | None, steady: bool = False, seconds_per_step: float = 15.0) -> None:
        self.steady, self.seconds_per_step = steady, seconds_per_step
        story = [load(s) for s in range(PERIOD)]
        self.lines = {
            (engine, phase): exposition(engine, keep, [load(self.offset(phase))] * PERIOD if steady else story)
            for engine in FIXTURES for phase in (range(PHASES) if steady else (0,))
        }
        self.cache: dict[tuple[str, int, int], bytes] = {}
        self.t0 = time.time()

    @staticmethod
    def offset(phase: int) -> int:
        return phase * (PERIOD // PHASES)

    @staticmethod
    def engine(i: int) -> str:
        return ("vllm", "sglang")[i % 2]

    def body(self, i: int) -> bytes:
        """Instance ``i``'s exposition now."""
        engine, phase = self.engine(i), (i // 2) % PHASES
        step = int((time.time() - self.t0) / self.seconds_per_step) + self.offset(phase)
        key = (engine, phase if self.steady else 0, step)
        out = self.cache.get(key)
        if out is None:
            if len(self.cache) > 4 * PHASES:
                self.cache.clear()
            lines = self.lines[key[:2]]
            out = "".join(x if isinstance(x, str) else x.prefix + _fmt(x.value(step)) + "\n" for x in lines).encode()
            self.cache[key] = out
        return out
