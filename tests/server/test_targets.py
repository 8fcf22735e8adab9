"""Targets from file_sd files (re-read on change, bad files keep the old list) and sharding."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvdiag.server.targets import FileSD, Shard, Target, combine, shard_of


def test_file_sd_json_and_yaml(tmp_path: Path) -> None:
    j = tmp_path / "a.json"
    j.write_text(json.dumps([{"targets": ["h1:8000", "h2:8000"], "labels": {"cluster": "x"}}]))
    y = tmp_path / "b.yaml"
    y.write_text("- targets: [h3:30000]\n")
    fj, fy = FileSD(j), FileSD(y)
    assert fj.refresh() and fy.refresh()
    assert [t.url for t in fj.targets] == ["h1:8000", "h2:8000"] and fj.targets[0].label_dict == {"cluster": "x"}
    assert [t.url for t in fy.targets] == ["h3:30000"]


def test_file_sd_is_reread_when_it_changes_and_a_bad_edit_keeps_the_old_targets(tmp_path: Path) -> None:
    path = tmp_path / "sd.json"
    path.write_text(json.dumps([{"targets": ["a:1"]}]))
    sd = FileSD(path)
    assert sd.refresh() and not sd.refresh()  # unchanged: not re-read
    path.write_text(json.dumps([{"targets": ["a:1", "b:1"]}]))
    os.utime(path, ns=(1, 10**18))
    assert sd.refresh() and [t.url for t in sd.targets] == ["a:1", "b:1"]
    path.write_text("[{\"targets\": ")
    os.utime(path, ns=(1, 2 * 10**18))
    assert not sd.refresh()
    assert sd.error and "sd.json" in sd.error
    assert [t.url for t in sd.targets] == ["a:1", "b:1"]


def test_shards_split_a_fleet_without_overlap_and_stably() -> None:
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(3000)]
    shards = [[u for u in urls if Shard(i, 3).keeps(u)] for i in range(3)]
    assert sorted(sum(shards, [])) == sorted(urls)
    assert all(800 < len(s) < 1200 for s in shards)
    assert shard_of("http://10.0.0.1:8000", 3) == shard_of("http://10.0.0.1:8000", 3)


def test_combine_keeps_the_first_definition_and_the_shard() -> None:
    static = [Target("a:1", (("k", "static"),))]
    sd = FileSD(Path("/nonexistent"))
    sd.targets = [Target("a:1", (("k", "sd"),)), Target("b:1")]
    both = combine(static, [sd], Shard())
    assert [(t.url, t.label_dict) for t in both] == [("a:1", {"k": "static"}), ("b:1", {})]
    assert len(combine(static, [sd], Shard(0, 2))) + len(combine(static, [sd], Shard(1, 2))) == 2
