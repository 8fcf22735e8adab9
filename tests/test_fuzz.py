"""Seeded fuzzing of the whole read path over real engine expositions.

Bodies: the two engine fixtures (reduced to the families kvdiag reads, so that
prometheus_client's slow parser can check every case), the reference engines' emitter in every
dialect and wire form, and the fixtures re-exposed by prometheus_client under each Prometheus 3
escaping scheme. Each case applies one to three mutations (special and out-of-range numbers,
cuts, blank-prefixed or quoted lines, a BOM, broken ``le``, stray characters, deleted or
repeated lines) and requires:

- nothing but kvdiag's own error types (``ExpositionError``, ``UnknownEngine``,
  ``TooManyInstances``) escapes the reader and the adapters;
- every figure a PoolSample holds is a possible value (finite, in its field's range);
- the diagnosis and ``inspect`` documents are strict JSON;
- no wrong number and no dropped sample against prometheus_client: wherever both kvdiag and
  prometheus_client's parser accept a body, they read the same samples with the same values
  for every family kvdiag wants.

A second test runs whole windows of such scrapes through the checks (increases stay possible
counts, the report strict JSON). The case counts are fixed (never a time budget); a failure
names the seed that reproduces it.
"""

from __future__ import annotations

import json
import math
import random
import re
from functools import lru_cache

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from kvdiag import checks
from kvdiag.report.samples import sample_json
from kvdiag.config import Config
from kvdiag.engines import READER, TooManyInstances, UnknownEngine, normalize_scrape
from kvdiag.exposition import ExpositionError, _undots
from kvdiag.model import HISTOGRAM_FIELDS, NUMERIC_FIELDS, PoolSample, Scrape, violation
from kvdiag.refpool.emit import SGLANG_DIALECTS, VLLM_DIALECTS, EngineState, content_type, render
from kvdiag.report.json import dumps, report_json
from kvdiag.window import Window
from tests.conftest import SGLANG_FIXTURE, VLLM_FIXTURE, shared_fixture
from tests.dialects import ESCAPINGS, reexpose

CHUNKS = 16
CASES_PER_CHUNK = 250  # 4,000 cases in all
DIAGNOSE_EVERY = 8  # one case in 8 also runs the checks and renders --json
OURS = (ExpositionError, UnknownEngine, TooManyInstances)
T = "http://10.0.0.1:8000"

SPECIAL = [
    "NaN", "+Inf", "-Inf", "inf", "-0", "0", "1e308", "-1e308", "4.9e-324", "1e400", "-1e400", "1" + "0" * 401,
    "-5", "-1", "0.5", "1.33", "9007199254740993", "1e16", "0x10", "1_000", "", "abc", "1.0.0", "\u0661", "12 34",
]  # fmt: skip
LE = ["0,4", "NaN", "abc", "", "+Inf", "-Inf", "1e400", "0.05", " 1"]
JUNK = list('{}",=\\#\n\t :') + ["\ufeff", "\u00e9", "\x00", "# EOF\n", "\n# TYPE x gauge\n", '{"', "_total"]


def _reduced(text: str) -> str:
    """A fixture with only the families kvdiag reads and their HELP/TYPE lines."""
    keep = []
    for line in text.splitlines(keepends=True):
        name = line.split(" ")[2] if line.startswith("# ") and len(line.split(" ")) > 2 else re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in READER._resolve or name in READER._types:
            keep.append(line)
    return "".join(keep)


def _state(i: int) -> EngineState:
    st = EngineState(
        capacity_tokens=100_000, used_tokens=90_000 + i, evictable_tokens=2_500, running=40, waiting=12 + i,
        evictions_total=30 + i, last_eviction_event=3, prefix_hit_tokens_total=70_000, prompt_tokens_total=100_000, prefill_input_tokens_total=30_000,
        generation_tokens_total=20_000, requests_total=300,
    )  # fmt: skip
    for v in (0.05, 0.3, 2.0, 30.0):
        st.ttft.observe(v)
        st.queue_time.observe(v)
    return st


@lru_cache(maxsize=1)
def corpus() -> list[tuple[str, str | None]]:
    """(body, content type) seeds: fixtures, every emitter dialect and wire, every escaping."""
    bodies: list[tuple[str, str | None]] = []
    for name in (SGLANG_FIXTURE, VLLM_FIXTURE):
        text = _reduced(shared_fixture(name).read_text())
        bodies.append((text, None))
        for escaping in ESCAPINGS:
            for om in (False, True):
                bodies.append(reexpose(text, escaping, om))
    for engine, dialects in (("sglang", SGLANG_DIALECTS), ("vllm", VLLM_DIALECTS)):
        for dialect in dialects:
            for om, escape in ((False, False), (True, False), (True, True)):
                states = [_state(0)] if (engine, dialect) == ("vllm", "0.6") else [_state(0), _state(1)]  # V0: one engine
                bodies.append((render(engine, states, dialect, openmetrics=om, escape=escape), content_type(om)))
    return bodies


# --- mutations: each takes (rng, text) and returns the new text --------------------------------


def _sample_lines(text: str) -> list[tuple[int, int]]:
    """(start, end) of every non-comment, non-empty line."""
    out, pos = [], 0
    for line in text.split("\n"):
        if line and not line.lstrip().startswith("#"):
            out.append((pos, pos + len(line)))
        pos += len(line) + 1
    return out


def _on_a_line(rng: random.Random, text: str, fn) -> str:  # noqa: ANN001
    lines = _sample_lines(text)
    if not lines:
        return text
    a, b = rng.choice(lines)
    return text[:a] + fn(text[a:b]) + text[b:]


def m_value(rng: random.Random, text: str) -> str:
    return _on_a_line(rng, text, lambda line: line.rsplit(" ", 1)[0] + " " + rng.choice(SPECIAL))


def m_le(rng: random.Random, text: str) -> str:
    spots = [m.span(1) for m in re.finditer(r'le="([^"]*)"', text)]
    if not spots:
        return text
    a, b = rng.choice(spots)
    return text[:a] + rng.choice(LE) + text[b:]


def m_cut(rng: random.Random, text: str) -> str:
    return text[: rng.randrange(len(text) + 1)]


def m_indent(rng: random.Random, text: str) -> str:
    return _on_a_line(rng, text, lambda line: rng.choice([" ", "\t", "  \t"]) + line)


def m_bom(rng: random.Random, text: str) -> str:
    return "\ufeff" + text


def m_quote(rng: random.Random, text: str) -> str:
    def quote(line: str) -> str:
        name, brace, rest = re.match(r"([^{ \t]*)(\{?)(.*)", line, re.S).groups()  # type: ignore[union-attr]
        if brace:
            return "{" + json.dumps(name) + ("" if rest.startswith("}") else ",") + rest
        return "{" + json.dumps(name) + "}" + rest

    return _on_a_line(rng, text, quote)


def m_junk(rng: random.Random, text: str) -> str:
    i = rng.randrange(len(text) + 1)
    return text[:i] + rng.choice(JUNK) + text[i + rng.choice([0, 0, 1]) :]


def m_drop_line(rng: random.Random, text: str) -> str:
    lines = text.split("\n")
    del lines[rng.randrange(len(lines))]
    return "\n".join(lines)


def m_repeat_line(rng: random.Random, text: str) -> str:
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    lines.insert(rng.randrange(len(lines) + 1), lines[i])
    return "\n".join(lines)


def m_label_value(rng: random.Random, text: str) -> str:
    spots = [m.span(1) for m in re.finditer(r'="([^"\\]*)"', text)]
    if not spots:
        return text
    a, b = rng.choice(spots)
    return text[:a] + rng.choice(['\\"', "\\\\", "\\n", "a,b", "}{", "#", "\\q", "\u00e9", ""]) + text[b:]


MUTATIONS = [m_value, m_value, m_value, m_le, m_cut, m_indent, m_bom, m_quote, m_quote, m_junk, m_junk, m_drop_line, m_repeat_line, m_label_value]


def mutate(seed: int) -> tuple[str, str | None, str]:
    """(body, content type, description) of case ``seed``."""
    rng = random.Random(seed)
    body, ctype = rng.choice(corpus())
    names = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        fn = rng.choice(MUTATIONS)
        body = fn(rng, body)
        names.append(fn.__name__)
    return body, ctype, "+".join(names)


# --- the oracle ---------------------------------------------------------------------------------


def reference(body: str, openmetrics: bool) -> dict[tuple[str, frozenset], float] | None:
    """prometheus_client's reading of the wanted families (keyed as kvdiag keys them), or None
    when it refuses the body."""
    try:
        families = list((parse_openmetrics if openmetrics else parse_text)(body))
    except Exception:  # noqa: BLE001 (prometheus_client raises ValueError, KeyError, IndexError...)
        return None
    out: dict[tuple[str, frozenset], float] = {}
    for fam in families:
        for s in fam.samples:
            hit = READER._resolve.get(s.name)
            if hit is None:
                continue
            fam_name, suffix, scheme = hit
            labels = {(_undots(k) if scheme == "dots" else k): v for k, v in s.labels.items()}
            key = (fam_name + suffix, frozenset(labels.items()))
            if key in out:  # a duplicate series: kvdiag refuses such a body, no value to compare
                return None
            try:
                out[key] = float(s.value)
            except OverflowError:  # an integer beyond float range, which kvdiag refuses
                return None
    return out


def ours(expo) -> dict[tuple[str, frozenset], float]:  # noqa: ANN001
    return {(f.name + s.suffix, frozenset(s.labels.items())): s.value for f in expo.families.values() for s in f.samples}


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def check_sample(ps: PoolSample, where: str) -> None:
    for name in NUMERIC_FIELDS:
        v = getattr(ps, name)
        if v is not None:
            assert violation(name, float(v)) is None, f"{where}: {name}={v!r} reached a PoolSample"
    for name in HISTOGRAM_FIELDS:
        h = getattr(ps, name)
        if h is not None:
            assert all(math.isfinite(c) and c >= 0 for c in h.counts), f"{where}: {name} counts {h.counts}"
            assert list(h.counts) == sorted(h.counts), f"{where}: {name} not cumulative"


def strict(doc: object, where: str) -> None:
    text = dumps(doc)

    def refuse(const: str) -> object:
        raise AssertionError(f"{where}: non-standard JSON constant {const}")

    json.loads(text, parse_constant=refuse)


def run_case(seed: int, config: Config) -> str:
    """One case; returns what happened (for the summary), raises on a broken promise."""
    body, ctype, how = mutate(seed)
    where = f"seed {seed} ({how})"
    try:
        expo = READER.read(body, ctype)
    except ExpositionError:
        return "refused"
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{where}: reader raised {type(exc).__name__}: {exc}") from exc
    ref = reference(body, expo.openmetrics)
    if ref is not None:
        got = ours(expo)
        assert set(got) == set(ref), f"{where}: samples differ from prometheus_client: only kvdiag {sorted(set(got) - set(ref))[:3]}, only prometheus_client {sorted(set(ref) - set(got))[:3]}"
        wrong = [k for k, v in ref.items() if not _same(got[k], v)]
        assert not wrong, f"{where}: values differ from prometheus_client at {wrong[:3]}"
    try:
        samples = normalize_scrape(Scrape(1000.0, T, ctype, body), max_instances=64)
    except (UnknownEngine, TooManyInstances):
        return "no engine"
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{where}: normalize raised {type(exc).__name__}: {exc}") from exc
    for ps in samples:
        check_sample(ps, where)
        strict(sample_json(ps), where)
    if seed % DIAGNOSE_EVERY == 0:
        clean, clean_ctype = corpus()[0] if samples[0].engine == "sglang" else corpus()[9]
        history = [s for i in range(3) for s in normalize_scrape(Scrape(1000.0 - 45 + 15 * i, T, clean_ctype, clean))]
        mine = {s.instance for s in samples}
        for inst in mine:
            w = Window(inst, [s for s in history if s.instance == inst] + [s for s in samples if s.instance == inst])
            d = checks.diagnose(w, config)
            strict(report_json([d], d.verdict.exit_code), where)
    return "read"


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_fuzzed_expositions_keep_every_promise(chunk: int) -> None:
    config = Config()
    seen: dict[str, int] = {}
    for seed in range(chunk * CASES_PER_CHUNK, (chunk + 1) * CASES_PER_CHUNK):
        outcome = run_case(seed, config)
        seen[outcome] = seen.get(outcome, 0) + 1
    # The mutator must exercise both sides: bodies read and bodies refused.
    assert seen.get("read", 0) > CASES_PER_CHUNK // 10 and seen.get("refused", 0) > 0, seen


def test_the_corpus_covers_every_dialect_and_scheme() -> None:
    bodies = corpus()
    assert len(bodies) == 2 * (1 + 2 * len(ESCAPINGS)) + 3 * (len(SGLANG_DIALECTS) + len(VLLM_DIALECTS))
    for body, ctype in bodies:  # unmutated, each seed is read and normalizes to an engine
        assert normalize_scrape(Scrape(1000.0, T, ctype, body)), body[:80]


SERIES = 120  # windows of 2-12 scrapes, each scrape mutated or not


def test_fuzzed_series_diagnose_to_strict_json() -> None:
    """Whole windows of mutated scrapes (a NaN here, a negative counter there, a broken bucket
    bound, a lost line): the checks run, every increase is a possible count, the report is strict
    JSON."""
    config = Config()
    counters = [f for f in NUMERIC_FIELDS if f.endswith("_total")]
    for seed in range(SERIES):
        rng = random.Random(10**6 + seed)
        base, ctype = rng.choice(corpus())
        samples: list[PoolSample] = []
        for i in range(rng.randint(2, 12)):
            body = base
            if rng.random() < 0.6:
                for _ in range(rng.randint(1, 3)):
                    body = rng.choice([m_value, m_value, m_le, m_drop_line])(rng, body)
            try:
                samples += normalize_scrape(Scrape(1000.0 + 15 * i, T, ctype, body))
            except OURS:
                continue
        for inst in {s.instance for s in samples}:
            w = Window(inst, [s for s in samples if s.instance == inst])
            for name in counters:
                inc = w.increase(name)
                assert inc is None or (math.isfinite(inc) and inc >= 0), f"seed {seed}: increase({name}) = {inc}"
            d = checks.diagnose(w, config)
            strict(report_json([d], d.verdict.exit_code), f"series seed {seed}")
