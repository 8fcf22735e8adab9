"""The targeted exposition reader: exact numbers, every format trait, and hostile input."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.engines import READER
from kvdiag.exposition import DEFAULT_MAX_BYTES, ExpositionError, Reader


def _reference(text: str, wanted: set[str]) -> dict[tuple[str, tuple], float]:
    """prometheus_client's own parse of the wanted families, keyed by (sample name, labels)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            base = fam.name
            if base in wanted or base.replace(":", "_") in {w.replace(":", "_") for w in wanted}:
                if s.name.endswith("_created"):
                    continue
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _ours(expo) -> dict[tuple[str, tuple], float]:
    return {
        (fam.name + s.suffix, tuple(sorted(s.labels.items()))): s.value
        for fam in expo.families.values()
        for s in fam.samples
    }


@pytest.mark.parametrize("fixture", ["sglang_fixture", "vllm_fixture"])
def test_real_fixtures_match_prometheus_client(fixture: str, request: pytest.FixtureRequest) -> None:
    text = request.getfixturevalue(fixture)
    expo = READER.read(text)
    ref = _reference(text, set(READER.wanted))
    ours = _ours(expo)
    assert ours, "no wanted family found"
    assert set(ours) == set(ref)
    for key, v in ref.items():
        assert ours[key] == v or (math.isnan(v) and math.isnan(ours[key])), key
    assert not expo.openmetrics


def test_counter_typed_under_total_in_text_and_family_in_openmetrics() -> None:
    reader = Reader(["vllm:num_preemptions"])
    text = (
        "# HELP vllm:num_preemptions_total x\n# TYPE vllm:num_preemptions_total counter\n"
        'vllm:num_preemptions_total{engine="0"} 7.0\n'
        "# HELP vllm:num_preemptions_created x\n# TYPE vllm:num_preemptions_created gauge\n"
        'vllm:num_preemptions_created{engine="0"} 1.7e9\n'
    )
    fam = reader.read(text).families["vllm:num_preemptions"]
    assert fam.type == "counter"
    assert [(s.suffix, s.value) for s in fam.samples] == [("_total", 7.0)]
    om = (
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0"} 9.0\n'
        'vllm:num_preemptions_created{engine="0"} 1.7e9\n# EOF\n'
    )
    expo = reader.read(om, "application/openmetrics-text; version=1.0.0")
    assert expo.openmetrics
    assert [(s.suffix, s.value) for s in expo.families["vllm:num_preemptions"].samples] == [("_total", 9.0)]


def test_underscore_escaped_names_match_colon_families() -> None:
    reader = Reader(["sglang:token_usage"])
    om = "# HELP sglang:token_usage u\n# TYPE sglang:token_usage gauge\nsglang_token_usage{tp_rank=\"0\"} 0.5\n# EOF\n"
    fam = reader.read(om).families["sglang:token_usage"]
    assert fam.escaped and fam.type == "gauge" and fam.samples[0].value == 0.5


def test_special_values_labels_and_order() -> None:
    reader = Reader(["m"])
    text = (
        'm{b="2",a="1"} NaN\n'
        'm{a="x\\"y\\\\z\\nw",b="}, #{="} +Inf\n'
        'm{a="3",} -Inf 1700000000000\n'
        "m 1.5e+07\n"
    )
    samples = reader.read(text).families["m"].samples
    assert math.isnan(samples[0].value) and samples[0].labels == {"a": "1", "b": "2"}
    assert samples[1].value == math.inf and samples[1].labels == {"a": 'x"y\\z\nw', "b": "}, #{="}
    assert samples[2].value == -math.inf and samples[2].timestamp == 1.7e12
    assert samples[3].value == 1.5e7 and samples[3].labels == {}


def test_unwanted_families_are_not_built_and_similar_names_do_not_match() -> None:
    reader = Reader(["vllm:num_requests_waiting"])
    text = 'vllm:num_requests_waiting_by_reason{reason="capacity"} 3\nvllm:num_requests_waiting 4\nother 1\n'
    expo = reader.read(text)
    assert list(expo.families) == ["vllm:num_requests_waiting"]
    assert [s.value for s in expo.families["vllm:num_requests_waiting"].samples] == [4.0]


@pytest.mark.parametrize(
    "body, reason",
    [
        ('m{a="1" 2\n', "malformed sample line"),
        ("m{a=1} 2\n", "malformed sample line"),
        ("m abc\n", "not a number"),
        ("m 1_000\n", "not a number"),
        ('m{a="1",a="2"} 3\n', "given twice"),
        ('m{a="1"} 3\nm{a="1"} 4\n', "duplicate series"),
        ("m 0.9", "truncated"),
        ("m 1 2 3\n", "malformed"),
        ("m 1 # {a=\"b\"} 1\n", "exemplars are only allowed in OpenMetrics"),
    ],
)
def test_malformed_wanted_lines_name_the_line(body: str, reason: str) -> None:
    with pytest.raises(ExpositionError) as err:
        Reader(["m"]).read(body)
    assert reason in str(err.value)
    assert err.value.lineno is not None and "line" in str(err.value)


def test_openmetrics_truncation_and_trailing_content() -> None:
    reader = Reader(["m"])
    with pytest.raises(ExpositionError, match="EOF"):
        reader.read("# TYPE m gauge\nm 1\n", "application/openmetrics-text")
    with pytest.raises(ExpositionError, match="after '# EOF'"):
        reader.read("m 1\n# EOF\nm 2\n# EOF\n", "application/openmetrics-text")


def test_size_cap_and_encoding() -> None:
    with pytest.raises(ExpositionError, match="cap"):
        Reader(["m"], max_bytes=10).read(b"m 1\n" * 10)
    with pytest.raises(ExpositionError, match="UTF-8"):
        Reader(["m"]).read(b"m 1\n\xff\xfe\n")
    assert DEFAULT_MAX_BYTES >= 1024 * 1024


# --- property tests: prometheus_client's own serializers are the oracle -----------------

_label_value = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_name = st.sampled_from(["kvx:g", "kvx:c", "kvx:h", "kvx_other"])
_number = st.one_of(
    st.floats(allow_nan=False, allow_infinity=True, width=64),
    st.integers(min_value=-(10**12), max_value=10**12).map(float),
)


@st.composite
def registries(draw: st.DrawFn) -> CollectorRegistry:
    n_series = draw(st.integers(min_value=1, max_value=4))
    labelsets = draw(
        st.lists(st.tuples(_label_value, _label_value), min_size=n_series, max_size=n_series, unique=True)
    )
    gauge = GaugeMetricFamily("kvx:g", "a gauge", labels=["a", "b"])
    counter = CounterMetricFamily("kvx:c", "a counter", labels=["a", "b"])
    hist = HistogramMetricFamily("kvx:h", "a histogram", labels=["a", "b"])
    other = GaugeMetricFamily("kvx_other", "not wanted", labels=["a"])
    for a, b in labelsets:
        gauge.add_metric([a, b], draw(_number))
        counter.add_metric([a, b], abs(draw(st.floats(min_value=0, max_value=1e15))))
        counts = sorted(draw(st.lists(st.integers(0, 10**6), min_size=3, max_size=3)))
        hist.add_metric([a, b], buckets=[("0.1", counts[0]), ("1.0", counts[1]), ("+Inf", counts[2])], sum_value=1.0)
        other.add_metric([a], 1.0)

    class Fixed:
        def collect(self):  # noqa: ANN202 (prometheus_client collector API)
            return [gauge, counter, hist, other]

    reg = CollectorRegistry()
    reg.register(Fixed())
    return reg


WANTED = ["kvx:g", "kvx:c", "kvx:h"]


def _expected(reg: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in reg.collect():
        if fam.name in WANTED:
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reg=registries(), openmetrics=st.booleans())
def test_roundtrip_of_prometheus_client_output(reg: CollectorRegistry, openmetrics: bool) -> None:
    body = (generate_openmetrics if openmetrics else generate_latest)(reg).decode()
    got = _ours(Reader(WANTED).read(body))
    want = _expected(reg)
    assert set(got) == set(want)
    assert all(_same(got[k], v) for k, v in want.items())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reg=registries(), openmetrics=st.booleans(), cut=st.floats(min_value=0, max_value=1))
def test_truncated_bodies_error_or_give_exact_subset(reg: CollectorRegistry, openmetrics: bool, cut: float) -> None:
    body = (generate_openmetrics if openmetrics else generate_latest)(reg).decode()
    truncated = body[: int(len(body) * cut)]
    want = _expected(reg)
    try:
        got = _ours(Reader(WANTED).read(truncated, "application/openmetrics-text" if openmetrics else None))
    except ExpositionError:
        return
    # Never a wrong number: whatever is read is exactly what was written.
    assert all(k in want and _same(v, want[k]) for k, v in got.items())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reg=registries(), pos=st.floats(min_value=0, max_value=1), junk=st.text(max_size=8))
def test_corrupted_bodies_never_crash_and_untouched_lines_stay_exact(reg: CollectorRegistry, pos: float, junk: str) -> None:
    body = generate_latest(reg).decode()
    i = int(len(body) * pos)
    corrupted = body[:i] + junk + body[i + 1 :]
    # Lines the corruption did not touch keep their numbers; the touched line may say
    # anything valid or be refused, but nothing may crash.
    start = body.rfind("\n", 0, i) + 1
    end = body.find("\n", i)
    touched_offsets = range(start, (end if end != -1 else len(body)) + len(junk) + 1)
    try:
        expo = Reader(WANTED).read(corrupted)
    except ExpositionError:
        return
    want = _expected(reg)
    for fam in expo.families.values():
        for s in fam.samples:
            if s.offset in touched_offsets or s.offset - 1 in touched_offsets:
                continue
            key = (fam.name + s.suffix, tuple(sorted(s.labels.items())))
            assert key in want and _same(s.value, want[key])


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    try:
        READER.read(data)
    except ExpositionError:
        pass


# --- what the reader refuses, and what it reads that a naive reader drops -----------------


def test_a_text_body_cut_anywhere_but_a_line_end_is_refused_with_the_line(vllm_fixture: str) -> None:
    # The reproduction: cut inside a TYPE line of a family kvdiag never builds samples for.
    cut = vllm_fixture[: vllm_fixture.index("# TYPE vllm:num_preemptions_total") + 20]
    with pytest.raises(ExpositionError, match="truncated") as err:
        READER.read(cut)
    assert err.value.line == "# TYPE vllm:num_pree" and err.value.lineno == cut.count("\n") + 1
    for i in range(1, len(vllm_fixture), 997):
        body = vllm_fixture[:i]
        if body.endswith("\n"):
            continue
        with pytest.raises(ExpositionError, match="truncated"):
            READER.read(body)


def test_openmetrics_eof_with_or_without_the_final_newline() -> None:
    reader = Reader(["m"])
    for body in ("# TYPE m gauge\nm 1\n# EOF\n", "# TYPE m gauge\nm 1\n# EOF"):
        assert reader.read(body, "application/openmetrics-text").families["m"].samples[0].value == 1.0
        assert [f.name for f in text_string_to_metric_families(body.replace("# EOF", ""))]  # the text oracle reads it too


def test_leading_blanks_bom_and_quoted_names_are_read() -> None:
    reader = Reader(["sglang:num_running_reqs", "m"])
    body = '\ufeffm 1\n  \tsglang:num_running_reqs{tp_rank="0"} 3\n{"m",a="x"} 2\n{ "sglang:num_running_reqs" , "gpu.id"="7" } 4\n'
    for raw in (body, body.encode()):
        expo = reader.read(raw)
        assert [(s.labels, s.value) for s in expo.families["m"].samples] == [({}, 1.0), ({"a": "x"}, 2.0)]
        assert [(s.labels, s.value) for s in expo.families["sglang:num_running_reqs"].samples] == [({"tp_rank": "0"}, 3.0), ({"gpu.id": "7"}, 4.0)]
    # prometheus_client agrees on every line it reads (it refuses the BOM).
    ref = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(body[1:]) for s in f.samples}
    assert ref[("sglang:num_running_reqs", (("gpu.id", "7"),))] == 4.0 and ref[("m", (("a", "x"),))] == 2.0


def test_quoted_type_line_types_the_family() -> None:
    expo = Reader(["a:b"]).read('# TYPE "a:b" counter\n{"a:b_total"} 5\n')
    fam = expo.families["a:b"]
    assert fam.type == "counter" and [(s.suffix, s.value) for s in fam.samples] == [("_total", 5.0)]


@pytest.mark.parametrize(
    "raw, reason",
    [
        ("1" + "0" * 400, "beyond float range"),
        ("-1e400", "beyond float range"),
        ("0x1p3", "not a number"),
        ("\u0661\u0662", "not a number"),  # Arabic-Indic digits: float() reads 12, Go refuses
    ],
)
def test_numbers_go_refuses_are_refused(raw: str, reason: str) -> None:
    with pytest.raises(ExpositionError, match=reason) as err:
        Reader(["m"]).read(f"m 1\nm{{a=\"b\"}} {raw}\n")
    assert err.value.lineno == 2


@pytest.mark.parametrize("raw, want", [("+Inf", math.inf), ("-Inf", -math.inf), ("inf", math.inf), ("Infinity", math.inf), ("4.9e-324", 5e-324), ("1e-400", 0.0)])
def test_infinities_as_written_and_underflow_are_numbers(raw: str, want: float) -> None:
    assert Reader(["m"]).read(f"m {raw}\n").families["m"].samples[0].value == want


def test_an_exposition_opening_with_a_brace_is_not_a_recording(tmp_path, capsys: pytest.CaptureFixture[str], sglang_fixture: str) -> None:  # noqa: ANN001
    import json

    from kvdiag import cli

    line = re.search(r"(?m)^sglang:num_running_reqs\{.*\n", sglang_fixture).group(0)  # type: ignore[union-attr]
    body = line.replace("sglang:num_running_reqs{", '{"sglang:num_running_reqs",') + sglang_fixture.replace(line, "")
    path = tmp_path / "quoted.prom"
    path.write_text(body)
    assert cli.main(["inspect", "--json", str(path)]) == 0
    [inst] = json.loads(capsys.readouterr().out)["instances"]
    assert inst["running"] == 48 and inst["engine"] == "sglang"


# --- conformance-style cases (after the OpenMetrics and client_python parser suites) ---------

TEXT_OK = [
    ("m 1\n", [({}, 1.0)]),
    ("m{} 1\n", [({}, 1.0)]),
    ('m{a="b",} 1\n', [({"a": "b"}, 1.0)]),
    ('m{ a = "b" , c="d"} 1\n', [({"a": "b", "c": "d"}, 1.0)]),
    ("m\t1\t1700000000000\n", [({}, 1.0)]),
    ("\n\n# a comment\n# HELP m with \\\\ and \\n\n# TYPE m gauge\nm -0\n\n", [({}, -0.0)]),
    ("m +1.5e3\n", [({}, 1500.0)]),
    ("m .5\n", [({}, 0.5)]),
    ('m{a="\\u0041"} 1\n', [({"a": "\\u0041"}, 1.0)]),
    ('m{a="#"} 1\n', [({"a": "#"}, 1.0)]),
    ("m NaN\n", [({}, math.nan)]),
    (" \tm 2\n", [({}, 2.0)]),
    ('{"m"} 3\n', [({}, 3.0)]),
    ('{"m","a"="b"} 3\n', [({"a": "b"}, 3.0)]),
]

TEXT_REFUSED = [
    ("m 1", "truncated"),
    ("m 1\r\n", "not a number"),
    ("m 1\x00\n", "not a number"),
    ('m{a="b"\n', "malformed"),
    ('m{a="b"} 1 2 3\n', "malformed"),
    ("m 1\nm 1\n", "duplicate"),
    ('m{a="1",a="2"} 1\n', "twice"),
    ("m 1e999\n", "beyond float range"),
    ('m 1 # {a="b"} 1\n', "exemplars"),
]

OPENMETRICS_REFUSED = [
    ("# TYPE m gauge\nm 1\n", "EOF"),
    ("m 1\n# EOF\nm 2\n# EOF\n", "after '# EOF'"),
    (" m 1\n# EOF\n", "no blank"),
]


@pytest.mark.parametrize("body, want", TEXT_OK)
def test_conformance_text_bodies_read_exactly(body: str, want: list) -> None:
    got = [(s.labels, s.value) for s in Reader(["m"]).read(body).families["m"].samples]
    assert len(got) == len(want) and all(g[0] == w[0] and _same(g[1], w[1]) for g, w in zip(got, want))
    try:  # prometheus_client agrees wherever it reads the body at all
        ref = [(s.labels, s.value) for f in text_string_to_metric_families(body) for s in f.samples if s.name == "m"]
    except Exception:  # noqa: BLE001
        return
    assert len(ref) == len(want) and all(r[0] == w[0] and _same(r[1], w[1]) for r, w in zip(ref, want))


@pytest.mark.parametrize("body, reason", TEXT_REFUSED)
def test_conformance_text_bodies_refused_with_the_reason(body: str, reason: str) -> None:
    with pytest.raises(ExpositionError, match=reason):
        Reader(["m"]).read(body)


@pytest.mark.parametrize("body, reason", OPENMETRICS_REFUSED)
def test_conformance_openmetrics_bodies_refused_with_the_reason(body: str, reason: str) -> None:
    with pytest.raises(ExpositionError, match=reason):
        Reader(["m"]).read(body, "application/openmetrics-text; version=1.0.0")
