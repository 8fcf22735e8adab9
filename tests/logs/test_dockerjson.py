"""Docker's json-file records: unwrapping, joining cut messages per stream, what is not a record,
and the warning when lines look like engine stats but none parses (no engine wheels needed)."""

from __future__ import annotations

import io
import json
from datetime import datetime, timezone

import pytest

from kvdiag.sources.dockerjson import MAX_JOINED, unwrap
from kvdiag.sources.logs import read_log

DECODE = ("[2026-11-29 11:33:15 DP1 TP0] Decode batch, #running-req: 12, #token: 3000, token usage: 0.97, "
          "cuda graph: True, gen throughput (token/s): 1389.42, #queue-req: 3")
STAMP = "2026-11-29T11:33:15.987654321Z"


def rec(log: str, stream: str = "stderr", time: str | None = STAMP, spaced: bool = False) -> str:
    obj: dict[str, str] = {"log": log, "stream": stream}
    if time is not None:
        obj["time"] = time
    return json.dumps(obj, separators=(", ", ": ") if spaced else (",", ":")) + "\n"


def numbered(*lines: str) -> list[tuple[int, str]]:
    return list(enumerate(lines, 1))


def test_a_record_becomes_a_timestamped_line() -> None:
    assert list(unwrap(numbered(rec(DECODE + "\n")))) == [(1, f"{STAMP} {DECODE}\n")]
    assert list(unwrap(numbered(rec(DECODE + "\n", spaced=True)))) == [(1, f"{STAMP} {DECODE}\n")]


def test_cut_messages_join_per_stream_numbered_by_their_first_record() -> None:
    out_a, out_b = "access line, first half ", "second half\n"
    lines = numbered(rec(DECODE[:50]), rec(out_a, "stdout"), rec(DECODE[50:100]), rec(out_b, "stdout"),
                     rec(DECODE[100:] + "\n"))
    assert list(unwrap(lines)) == [(2, f"{STAMP} {out_a}{out_b}"), (1, f"{STAMP} {DECODE}\n")]


def test_what_is_not_a_record_passes_unchanged() -> None:
    lines = ["plain line\n", '{"message": "Decode batch"}\n', '{"log": 3}\n', '{"log":"cut by a crash', "\n", ""]
    assert [text for _, text in unwrap(numbered(*lines))] == lines


def test_a_record_without_time_keeps_the_engine_stamp() -> None:
    [(_, text)] = unwrap(numbered(rec(DECODE + "\n", time=None)))
    assert text == DECODE + "\n"


def test_a_file_ending_inside_a_cut_message_gives_what_it_has() -> None:
    assert list(unwrap(numbered(rec("start of a message")))) == [(1, f"{STAMP} start of a message")]


def test_an_endless_message_is_kept_to_a_bound() -> None:
    chunk = "x" * 16384
    [(_, text)] = unwrap(numbered(*[rec(chunk)] * 20, rec("end\n")))
    assert len(text) == len(STAMP) + 1 + MAX_JOINED


def test_json_file_log_reads_with_the_record_time() -> None:
    stream = read_log(io.StringIO(rec(DECODE[:80]) + rec("GET /health\n", "stdout") + rec(DECODE[80:] + "\n")),
                      name="c.log")
    (sample,) = list(stream)
    assert (sample.instance, sample.running, sample.waiting, sample.usage_ratio) == ("c.log dp_rank=1", 12, 3, 0.97)
    at = datetime(2026, 11, 29, 11, 33, 15, tzinfo=timezone.utc).timestamp()
    assert sample.ts == pytest.approx(at + 0.987654321, abs=1e-6)  # the record's time, not the engine's
    assert sample.provenance["running"].metric == "c.log:1"
    assert stream.report.assumptions == []  # the record's time carries its zone


def test_stats_lines_nobody_reads_warn_with_a_count_and_an_example() -> None:
    sglang = '{"message": "' + DECODE + '"}\n'
    vllm = ('{"message": "(APIServer pid=1) INFO 11-29 11:33:15 [loggers.py:335] Engine 000: Avg prompt throughput: '
            '1.0 tokens/s, Avg generation throughput: 2.0 tokens/s, Running: 3 reqs, Waiting: 0 reqs, GPU KV cache '
            'usage: 5.0%"}\n')
    for line in (sglang, vllm):
        stream = read_log(io.StringIO(line * 3), name="s.log")
        assert list(stream) == []
        warning = stream.report.warning()
        assert warning is not None and warning.startswith("warning: 3 line(s) look like engine stats and none parses")
        assert "e.g. s.log:1: '{\"message\"" in warning and warning in stream.report.describe()


def test_a_quoted_marker_beside_lines_that_parse_is_no_warning() -> None:
    stream = read_log(io.StringIO(DECODE + "\n" + '{"prompt": "explain Decode batch lines"}\n'), name="s.log")
    assert len(list(stream)) == 1
    assert stream.report.mentions == 1 and stream.report.warning() is None
