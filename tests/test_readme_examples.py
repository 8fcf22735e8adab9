"""The README's examples, run as a newcomer would paste them, against the output the README
shows: the CLI's diagnosis of a simulated incident, the mixin's checks and the what-if table.

Each ``console`` block is a series of ``$ command`` lines, each followed by what it prints. Here
every printed line of the README must appear in the command's output, in order, as a prefix of
an output line (the README cuts wide tables); a line that starts with ``...`` stands for lines
the README leaves out. Durations and clock times are the only figures allowed to differ. The
exporter's block (a background server and a minute's wait) and the real-engine block (a real
server) are run by tests/server and tests/real instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import hang_guard
from tests.mixin.conftest import need

ROOT = Path(__file__).resolve().parents[1]
WIDE = 200  # a wide terminal: the README cuts the what-if table's last column


@dataclass(frozen=True)
class Example:
    command: str
    shown: tuple[str, ...]  # what the README shows it print


def _examples(heading: str) -> list[Example]:
    """The ``console`` block under a README heading, as examples."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"### {heading}\n", 1)[1]
    block = re.search(r"```console\n(.*?)```", section, re.S)
    assert block is not None, heading
    examples: list[Example] = []
    for line in block.group(1).splitlines():
        if line.startswith("$ "):
            examples.append(Example(line[2:], ()))
        elif examples and line.strip():
            examples[-1] = Example(examples[-1].command, (*examples[-1].shown, line.rstrip()))
    return examples


def _same(line: str) -> str:
    """A line with the figures that change from run to run (durations, clock times) masked."""
    return re.sub(r"\d\d:\d\d:\d\d", "HH:MM:SS", re.sub(r"\bin \d+(\.\d+)?s\b", "in Ns", line))


def _run(example: Example, cwd: Path) -> None:
    width = max((len(x) for x in example.shown), default=0) if any(x.startswith("╭") for x in example.shown) else WIDE
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "COLUMNS": str(width)}
    proc = subprocess.run(["bash", "-c", example.command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=hang_guard(60))  # fmt: skip
    assert proc.returncode in (0, 2), (example.command, proc.returncode, proc.stdout[-2000:])  # 2: the verdict is L1
    out = [_same(x.rstrip()) for x in proc.stdout.splitlines()]  # what a terminal shows: stdout and stderr
    at = 0
    for shown in example.shown:
        if shown.lstrip().startswith("..."):
            continue
        want = _same(shown)
        found = next((i for i in range(at, len(out)) if out[i].startswith(want)), None)
        assert found is not None, f"$ {example.command}\nthe README shows:\n{shown}\nit printed:\n" + "\n".join(out[at:])[-4000:]
        at = found + 1


def test_the_cli_and_what_if_examples(tmp_path: Path) -> None:
    """``simulate`` writes the incident both blocks read; ``diagnose`` gives the README's box."""
    for example in _examples("CLI: diagnose an incident") + _examples("What-if: each remedy replayed"):
        _run(example, tmp_path)


def test_the_mixin_examples() -> None:
    need("promtool")
    examples = _examples("Mixin: Prometheus rules and Grafana dashboards")
    assert [e.command.split()[0] for e in examples] == ["kvdiag", "promtool", "grep"]
    for example in examples:
        _run(example, ROOT)


def test_an_example_that_lies_fails(tmp_path: Path) -> None:
    """The comparison can fail: a line the command never printed, or lines out of order."""
    _run(Example("printf 'a\\nb 1.5s\\nc\\n'", ("a", "...", "c")), tmp_path)
    for shown in (("a", "d"), ("c", "a")):
        with pytest.raises(AssertionError, match="the README shows"):
            _run(Example("printf 'a\\nb\\nc\\n'", shown), tmp_path)
