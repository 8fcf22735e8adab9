"""Issue 30, item 6: YAML tags, complex keys and duplicate keys anywhere in the config are one
clear error with the file and line, in ``serve --config`` and ``diagnose --config`` alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag import config as checks_config
from kvdiag.config import ConfigError
from kvdiag.server import settings as serve_settings

CASES = [
    ("checks: {window: !custom 5m}\n", 1, "the YAML tag '!custom' is not allowed"),
    ("listen: !!python/name:os.system\n", 1, "the YAML tag 'tag:yaml.org,2002:python/name:os.system' is not allowed"),
    ("scrape:\n  ? [a, b]\n  : 1\n", 2, "scrape.<list>: a key must be a plain name, not a list"),
    ("scrape:\n  ? {a: 1}\n  : 1\n", 2, "a key must be a plain name, not a mapping"),
    ("scrape:\n  interval: 5s\n  interval: 10s\n", 3, "scrape.interval is given twice"),
    ("scrape:\n  auth:\n    bearer_token: a\n    bearer_token: b\n", 4, "scrape.auth.bearer_token is given twice"),
    ("targets:\n  - {url: http://a:1, url: http://b:1}\n", 2, r"targets\[0\].url is given twice"),
    ("probe:\n  hosts: !!set {a, b}\n", 2, "tag:yaml.org,2002:set"),
    ("checks:\n  window: !!binary aGVsbG8=\n", 2, "tag:yaml.org,2002:binary"),
    ("base: &b {interval: 5s}\nscrape:\n  <<: *b\n", 3, "tag:yaml.org,2002:merge"),
    ("checks:\n  window: 2026-13-45\n", 2, "month must be in 1..12"),
]


@pytest.mark.parametrize("text, line, words", CASES)
def test_refused_with_file_and_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = tmp_path / "kvdiag.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"kvdiag\.yaml:{line}: .*{words}"):
        serve_settings.load(path)


@pytest.mark.parametrize("command", ["serve", "diagnose"])
def test_the_commands_say_so_without_a_traceback(tmp_path: Path, command: str) -> None:
    for i, (text, line, _) in enumerate(CASES[:2] + CASES[4:5]):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(text)
        args = ["--config", str(path)] + (["x.prom"] if command == "diagnose" else [])
        proc = subprocess.run([sys.executable, "-m", "kvdiag", command, *args], capture_output=True, text=True, timeout=120)
        if command == "diagnose" and text.startswith(("listen", "scrape")):
            continue  # diagnose reads only `checks:`; the other sections are serve's
        assert proc.returncode == 3 and f"c{i}.yaml:{line}:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_anchors_and_aliases_of_plain_values_still_load(tmp_path: Path) -> None:
    path = tmp_path / "kvdiag.yaml"
    path.write_text("targets:\n  - &a http://10.0.0.5:30000\nfile_sd: []\nchecks:\n  window: &w 10m\n  queue_short_window: *w\n")
    s = serve_settings.load(path)
    assert s.checks.window == 600.0 == s.checks.queue_short_window and s.targets[0].url == "http://10.0.0.5:30000"
    assert checks_config.load(path).window == 600.0


def test_a_billion_laughs_is_walked_once_per_node(tmp_path: Path) -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    path = tmp_path / "kvdiag.yaml"
    path.write_text("\n".join(levels) + "\n")
    with pytest.raises(ConfigError, match="unknown key 'a0'"):
        serve_settings.load(path)  # 10^9 leaves as a tree; read as the 90 nodes it is
