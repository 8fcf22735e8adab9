"""How fast the CLI answers: ``kvdiag --help`` and a one-file ``kvdiag inspect``, in fresh processes.

Usage: .venv/bin/python bench/bench_cli.py [--rounds N] [--fixture FILE] [--baseline REV]

A CLI reached for during an incident should answer ``--help`` in under 0.3 s and inspect one
saved scrape in under 0.5 s. Each command runs as a user runs it (``python -m kvdiag ...``, a new
interpreter each time), ``--rounds`` times, the contenders in turn within each round so that a
change in the machine's load hits all alike; the median is reported beside the best. The named
baseline in the same run is the bare interpreter (``python -c pass``: what no CLI can beat), and
with ``--baseline REV`` the same commands on the tree of git revision REV (``git archive`` into a
temporary directory, its reference pool from source), timed in the same rounds.
Last line: JSON with each median in seconds, ``*_vs_target`` (median / target: below 1 meets it)
and, with a baseline, ``*_speedup_vs_baseline``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT.parent / "shared" / "fixtures" / "vllm-0.33.0-midload.prom"
#: Seconds a command may take, by name (the issue's targets).
TARGETS = {"help": 0.3, "inspect": 0.5}


def _commands(fixture: Path) -> dict[str, list[str]]:
    return {"help": ["--help"], "inspect": ["inspect", str(fixture)]}


def _time(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one run; in the directory first on its path, since ``python -m`` puts the
    working directory before PYTHONPATH."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], env=env, cwd=env["PYTHONPATH"].split(os.pathsep)[0], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - start


def _tree(rev: str, into: str) -> None:
    """The ``kvdiag`` package of revision ``rev``, unpacked under ``into``."""
    tar = subprocess.run(["git", "archive", rev, "kvdiag"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(into, filter="data")


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())  # fmt: skip
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} cores, {model}, Python {platform.python_version()}, load average {load}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--fixture", type=Path, default=FIXTURE, help="the one file inspect reads")
    ap.add_argument("--baseline", metavar="REV", help="also time the same commands at this git revision")
    args = ap.parse_args()
    here = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    contenders: dict[str, tuple[list[str], dict[str, str]]] = {"python": (["-c", "pass"], here)}
    for name, argv in _commands(args.fixture).items():
        contenders[name] = (["-m", "kvdiag", *argv], here)
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            _tree(args.baseline, tmp)
            there = os.environ | {"PYTHONPATH": tmp, "KVDIAG_PURE": "1"}
            for name, argv in _commands(args.fixture).items():
                contenders[f"baseline_{name}"] = (["-m", "kvdiag", *argv], there)
        for argv, env in contenders.values():
            _time(argv, env)  # warm the file cache and the bytecode of both trees
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, (argv, env) in contenders.items():
                times[name].append(_time(argv, env))
    print(f"machine: {_machine()}")
    result: dict[str, float | str] = {}
    for name, ts in times.items():
        median = statistics.median(ts)
        result[f"{name}_s"] = round(median, 3)
        line = f"{name:18s} median {median:.3f} s, best {min(ts):.3f} s over {len(ts)} runs"
        if name in TARGETS:
            result[f"{name}_vs_target"] = round(median / TARGETS[name], 2)
            line += f" (target {TARGETS[name]} s: {median / TARGETS[name]:.2f} of it)"
        if f"baseline_{name}" in times:
            result[f"{name}_speedup_vs_baseline"] = round(statistics.median(times[f"baseline_{name}"]) / median, 1)
        print(line)
    if args.baseline:
        result["baseline"] = args.baseline
    print(json.dumps(result))


if __name__ == "__main__":
    main()
