"""Saved scrape files as a time series: a folder of them, or several named together, diagnose
as the recording of the same scrapes does, timed by their names, else their modification times,
else their samples' own timestamps (said on stderr); files that cannot be ordered are refused
with the reason."""

from __future__ import annotations

import json
import os
import random
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvdiag.cli import main
from kvdiag.model import Scrape
from kvdiag.refpool.emit import content_type
from kvdiag.sources.recording import read_recording, write_recording
from kvdiag.sources.series import _name_time
from tests.conftest import SGLANG_FIXTURE, VLLM_FIXTURE, shared_fixture
from tests.scenario_recordings import INTERVAL, record

T0 = 1_795_000_000.0  # 2026-11-18 ...


@pytest.fixture(scope="module")
def bodies() -> tuple[str, ...]:
    """An SGLang engine's scrapes every 15 s while its KV pool saturates (the reference pool)."""
    (newest, *_) = record(("l1-saturation", "sglang"))
    return newest.bodies


def _stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _diagnose(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict], str]:
    code = main(["diagnose", "--json", *args])
    out = capsys.readouterr()
    return code, json.loads(out.out)["instances"], out.err


def _verdicts(instances: list[dict]) -> list[tuple[str, dict[str, str]]]:
    return [(i["verdict"], {name: c["status"] for name, c in i["checks"].items()}) for i in instances]


def test_a_folder_of_named_scrapes_diagnoses_as_their_recording(tmp_path: Path, bodies: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "bundle"
    folder.mkdir()
    scrapes = [Scrape(T0 + i * INTERVAL, "http://10.0.0.5:30000", content_type(False), b) for i, b in enumerate(bodies)]
    for s in scrapes:
        path = folder / f"sglang-{_stamp(s.ts)}.prom"
        path.write_text(s.body)
        os.utime(path, (T0, T0))  # unpacked from a bundle: one mtime for all, which must not be used
    write_recording(tmp_path / "rec.jsonl.gz", scrapes)

    code, from_files, err = _diagnose(capsys, str(folder))
    replay_code, from_recording, _ = _diagnose(capsys, "--replay", str(tmp_path / "rec.jsonl.gz"))
    assert (code, _verdicts(from_files)) == (replay_code, _verdicts(from_recording))
    assert from_files[0]["verdict"] == "l1_kv_bottleneck" and from_files[0]["instance"] == f"{folder}/"
    assert f"{len(bodies)} scrape files read as one series of {folder}/, timed by their file names" in err
    assert f"every {INTERVAL:g} s" in err


def test_files_named_together_are_timed_by_their_modification_times(tmp_path: Path, bodies: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    paths = []
    for i, body in enumerate(bodies):  # curl in a loop: m.0.prom, m.1.prom, ... (no time in the name)
        path = tmp_path / f"m.{i}.prom"
        path.write_text(body)
        os.utime(path, (T0 + i * INTERVAL, T0 + i * INTERVAL))
        paths.append(str(path))
    random.Random(3).shuffle(paths)  # named in any order: the times order them
    code, instances, err = _diagnose(capsys, *paths)
    assert code == 2 and [i["verdict"] for i in instances] == ["l1_kv_bottleneck"]
    assert instances[0]["instance"] == f"{tmp_path}/m.*.prom"
    assert "timed by their modification times" in err

    main(["inspect", "--json", *paths])
    shown = json.loads(capsys.readouterr().out)["instances"]
    assert [(i["instance"], i["samples"], i["ts"]) for i in shown] == [(f"{tmp_path}/m.*.prom", len(bodies), T0 + (len(bodies) - 1) * INTERVAL)]


def _with_timestamps(body: str, ts: float) -> str:
    """Every sample line with the scrape time as its own timestamp (ms, as text format 0.0.4 writes it)."""
    return "".join(line + (f" {int(ts * 1000)}\n" if line and not line.startswith("#") else "\n") for line in body.split("\n")[:-1])


def test_files_without_times_are_timed_by_their_samples_timestamps(tmp_path: Path, bodies: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    for i, body in enumerate(bodies):
        path = tmp_path / f"scrape-{chr(ord('a') + i // 26)}{chr(ord('a') + i % 26)}.prom"
        path.write_text(_with_timestamps(body, T0 + i * INTERVAL))
        os.utime(path, (T0, T0))
    code, instances, err = _diagnose(capsys, str(tmp_path))
    assert code == 2 and instances[0]["verdict"] == "l1_kv_bottleneck"
    assert "timed by their sample timestamps" in err


def test_files_that_cannot_be_ordered_are_refused_with_the_reason(tmp_path: Path, bodies: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    for name, body in (("a.prom", bodies[0]), ("b.prom", bodies[1]), ("c.prom", bodies[2])):
        (tmp_path / name).write_text(body)
        os.utime(tmp_path / name, (T0, T0))
    code = main(["diagnose", "--json", str(tmp_path / "a.prom"), str(tmp_path / "b.prom"), str(tmp_path / "c.prom")])
    err = capsys.readouterr().err
    assert code == 3
    assert "cannot put 3 scrape files in time order (a.prom, b.prom, c.prom)" in err and "rename them" in err


def test_two_engines_saved_side_by_side_stay_two_targets(capsys: pytest.CaptureFixture[str]) -> None:
    sglang, vllm = shared_fixture(SGLANG_FIXTURE), shared_fixture(VLLM_FIXTURE)
    assert main(["inspect", "--json", str(sglang), str(vllm)]) == 0
    out = capsys.readouterr()
    instances = json.loads(out.out)["instances"]
    assert sorted(i["engine"] for i in instances) == ["sglang", "vllm"]
    assert {i["instance"].split(" ")[0] for i in instances} == {str(sglang), str(vllm)}
    assert "series" not in out.err


def test_record_converts_a_folder_into_a_recording(tmp_path: Path, bodies: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "scrapes"
    folder.mkdir()
    for i, body in reversed(list(enumerate(bodies))):
        (folder / f"{int(T0) + i * int(INTERVAL)}.prom").write_text(body)  # Unix seconds in the names
    assert main(["record", str(folder), "--out", str(tmp_path / "rec.jsonl.gz")]) == 0
    assert "timed by their file names" in capsys.readouterr().err
    got = list(read_recording(tmp_path / "rec.jsonl.gz"))
    assert [s.ts for s in got] == [T0 + i * INTERVAL for i in range(len(bodies))]
    assert [s.body for s in got] == list(bodies) and {s.target for s in got} == {f"{folder}/"}
    assert main(["record", str(folder), "http://127.0.0.1:9", "--out", str(tmp_path / "x.jsonl.gz")]) == 3
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, when",
    [
        ("metrics-20261203T101500Z.prom", "2026-12-03T10:15:00+00:00"),
        ("vllm_2026-12-03_10-15-00.txt", "2026-12-03T10:15:00+00:00"),
        ("scrape.2026-12-03T11:15:00.250+01:00.prom", "2026-12-03T10:15:00.250000+00:00"),
        ("node-1-1796292900.prom", "2026-12-03T10:15:00+00:00"),
        ("m-1796292900250.prom", "2026-12-03T10:15:00.250000+00:00"),
        ("m.17.prom", None),
        ("build-20261399T999999.prom", None),  # digits, not a date
    ],
)
def test_times_in_file_names(name: str, when: str | None) -> None:
    got = _name_time(Scrape(0.0, f"/tmp/{name}", None, ""))
    assert (None if got is None else datetime.fromtimestamp(got, timezone.utc).isoformat()) == when


def test_the_series_module_knows_no_engine() -> None:
    source = (Path(__file__).resolve().parents[1] / "kvdiag" / "sources" / "series.py").read_text()
    assert not re.search(r"sglang|vllm", source.split('"""', 2)[2], re.I)
