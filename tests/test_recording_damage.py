"""Issue 30, item 2 (and the recording lines of items 8 and 10): a recording survives its
writer dying, a corrupt one is an error with the reason, and no line of one is a traceback."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import logging
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kvdiag.model import Scrape
from kvdiag.refpool.emit import EngineState, content_type, render
from kvdiag.sources.recording import RecordingError, RecordingWriter, read_recording

T = "http://10.0.0.7:30000"


def _kvdiag(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, timeout=300)


def scrapes(n: int) -> list[Scrape]:
    """An SGLang story in ``n`` scrapes 5 s apart: the pool fills, the queue grows."""
    out = []
    for i in range(n):
        st = EngineState(capacity_tokens=100_000, used_tokens=min(99_000, 60_000 + 2_000 * i), running=40, waiting=i, evictions_total=i // 3)
        out.append(Scrape(1_700_000_000.0 + 5 * i, T, content_type(True), render("sglang", [st], openmetrics=True, escape=True)))
    return out


def record(path: Path, items: list[Scrape], member_seconds: float = 10.0, close: bool = True) -> RecordingWriter:
    """Write ``items`` with a clock that advances 5 s per scrape (a 5 s interval)."""
    clock = itertools.count(0.0, 5.0)
    writer = RecordingWriter(path, member_seconds=member_seconds, clock=lambda: next(clock))
    for s in items:
        writer.write(s)
    if close:
        writer.close()
    return writer


def test_a_recording_cut_anywhere_reads_up_to_the_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    items = scrapes(12)
    full = tmp_path / "rec.jsonl.gz"
    record(full, items)
    data = full.read_bytes()
    assert [s.body for s in read_recording(full)] == [s.body for s in items]
    boundaries = _member_ends(data)
    assert len(boundaries) >= 5  # a member every 10 s of scrapes 5 s apart
    cut = tmp_path / "cut.jsonl.gz"
    step = max(1, len(data) // 97)
    for n in list(range(3, len(data), step)) + [len(data) - 1]:
        cut.write_bytes(data[:n])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvdiag.recording"):
            got = list(read_recording(cut))
        assert [s.body for s in got] == [s.body for s in items[: len(got)]], n  # a prefix, nothing wrong
        if n not in boundaries:  # a cut between two members is a shorter, whole recording
            assert f"the recording stops short (mid-gzip-member at byte {n}" in caplog.text and f"read up to line {len(got)}" in caplog.text, n


def test_every_flushed_line_survives_a_killed_writer(tmp_path: Path) -> None:
    items = scrapes(9)
    path = tmp_path / "killed.jsonl.gz"
    writer = record(path, items, member_seconds=10.0, close=False)  # killed: no close, no trailer
    assert writer.members == 4  # 5 s apart, a member every 10 s: 4 complete, the 9th line's open
    assert [s.body for s in read_recording(path)] == [s.body for s in items]
    # a tool other than kvdiag (gzip's own reader) reads every complete member: all but the last seconds
    complete = _whole_members(path.read_bytes())
    assert complete.count(b"\n") == 8
    writer.close()


def _member_ends(data: bytes) -> set[int]:
    ends, at = set(), 0
    while at < len(data):
        d = zlib.decompressobj(wbits=31)
        d.decompress(data[at:])
        at = len(data) - len(d.unused_data)
        ends.add(at)
    return ends


def _whole_members(data: bytes) -> bytes:
    out = b""
    while data:
        d = zlib.decompressobj(wbits=31)
        chunk = d.decompress(data)
        if not d.eof:
            break
        out += chunk
        data = d.unused_data
    return out


def test_diagnose_and_inspect_replay_a_cut_recording(tmp_path: Path) -> None:
    """The issue's reproduction: ``head -c N rec.jsonl.gz > cut.gz; kvdiag diagnose --replay cut.gz``."""
    full = tmp_path / "rec.jsonl.gz"
    with gzip.open(full, "wt") as fh:  # the old writer: one member, the trailer only on close
        for s in scrapes(40):
            fh.write(json.dumps({"ts": s.ts, "target": s.target, "content_type": s.content_type, "body": s.body}) + "\n")
    cut = tmp_path / "cut.gz"
    cut.write_bytes(full.read_bytes()[: len(full.read_bytes()) * 2 // 3])
    proc = _kvdiag("diagnose", "--replay", str(cut), "--json")
    assert proc.returncode in (0, 1, 2), proc.stderr
    assert "Traceback" not in proc.stderr and "stops short (mid-gzip-member at byte" in proc.stderr
    assert json.loads(proc.stdout)["instances"][0]["instance"] == T
    for args in (("inspect", "--replay", str(cut), "--json"), ("inspect", str(cut), "--json")):
        proc = _kvdiag(*args)
        assert proc.returncode == 0 and "stops short" in proc.stderr, proc.stderr
        assert json.loads(proc.stdout)["instances"][0]["samples"] >= 20


def test_a_corrupt_recording_exits_3_with_the_reason(tmp_path: Path) -> None:
    full = tmp_path / "rec.jsonl.gz"
    record(full, scrapes(12))
    data = bytearray(full.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(64)  # zeros in the middle of the deflate data
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(bytes(data))
    for args in (("diagnose", "--replay", str(bad), "--json"), ("inspect", "--replay", str(bad)), ("inspect", str(bad))):
        proc = _kvdiag(*args)
        assert proc.returncode == 3, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and "bad.jsonl.gz" in proc.stderr
        assert "corrupt gzip data" in proc.stderr or "not a recording line" in proc.stderr


def test_junk_after_the_gzip_data_is_an_error_and_zero_padding_is_not(tmp_path: Path) -> None:
    full = tmp_path / "rec.jsonl.gz"
    record(full, scrapes(3))
    padded = tmp_path / "padded.jsonl.gz"
    padded.write_bytes(full.read_bytes() + bytes(4096))
    assert len(list(read_recording(padded))) == 3
    junk = tmp_path / "junk.jsonl.gz"
    junk.write_bytes(full.read_bytes() + b"PK\x03\x04 not gzip")
    with pytest.raises(RecordingError, match="not a gzip member"):
        list(read_recording(junk))


LINE = {"ts": 1.0, "target": T, "content_type": None, "body": "x 1\n"}


@pytest.mark.parametrize(
    "line, reason",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # item 8: RecursionError
        ('{"ts": 1, "target": "t", "body": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        (json.dumps({**LINE, "content_type": 5}), "content_type must be a string"),  # item 8: AttributeError
        (json.dumps({**LINE, "ts": "soon"}), "ts must be a finite number"),
        ('{"ts": NaN, "target": "t", "body": "b"}', "ts must be a finite number"),
        (json.dumps({**LINE, "target": "http://h/\x1b[2J"}), "control characters"),
        (json.dumps([1, 2]), "a line is a JSON object"),
    ],
)
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(json.dumps(LINE) + "\n" + line + "\n")
    with pytest.raises(RecordingError, match=rf"rec\.jsonl:2: not a recording line \(.*{reason}"):
        list(read_recording(path))


def test_a_nested_line_exits_3_from_the_command(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text('{"ts": 1, "target": "t", "content_type": ' + "[" * 50_000 + "]" * 50_000 + ', "body": "b"}\n')
    proc = _kvdiag("inspect", "--replay", str(path))
    assert proc.returncode == 3 and "nested too deeply" in proc.stderr and "Traceback" not in proc.stderr


def test_a_password_in_a_recorded_target_is_never_printed(tmp_path: Path) -> None:
    """Item 10: a crafted recording whose target carries userinfo."""
    path = tmp_path / "rec.jsonl.gz"
    secret = [Scrape(s.ts, "http://admin:hunter2@10.0.0.7:30000", s.content_type, s.body) for s in scrapes(3)]
    with gzip.open(path, "wt") as fh:
        for s in secret:
            fh.write(json.dumps({"ts": s.ts, "target": s.target, "content_type": s.content_type, "body": s.body}) + "\n")
    assert {s.target for s in read_recording(path)} == {T}
    for args in (("inspect", "--replay", str(path)), ("inspect", "--replay", str(path), "--json"), ("diagnose", "--replay", str(path), "--json")):
        proc = _kvdiag(*args)
        assert proc.returncode in (0, 1, 2) and "hunter2" not in proc.stdout + proc.stderr, proc.stderr
        assert "10.0.0.7:30000" in proc.stdout


def test_the_writer_roundtrips_through_gzip_tools(tmp_path: Path) -> None:
    items = scrapes(7)
    path = tmp_path / "rec.jsonl.gz"
    record(path, items, member_seconds=10.0)
    lines = gzip.GzipFile(fileobj=io.BytesIO(path.read_bytes())).read().decode().splitlines()
    assert [json.loads(x)["body"] for x in lines] == [s.body for s in items]
