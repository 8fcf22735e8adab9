"""Baselines in one bench run: the reference pool's pure build, and the tree of another revision.

The compiled build runs in this process, the pure one (``KVDIAG_PURE=1``,
kvdiag/refpool/native.py) in a child running the same bench script: a process runs one build
for good (the compiled modules are imported once). Another revision's tree (``git archive``
into a temporary directory, first on the child's path) runs its own copy of the script, built
as that revision builds itself (its own scripts/build-native.py, before anything is timed) or
pure where it has no compiled build, so a speed-up is measured against the code it replaces,
built alike, on the same machine in the same minutes, not against a figure from another day.
Either child prints its figures as JSON on its last line, which is returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path
from typing import Callable, Iterator

from kvdiag.refpool import native


def this_build() -> str:
    return native.install().reason


def in_pure_build(script: str, argv: list[str]) -> dict[str, object]:
    env = os.environ | {native.PURE_ENV: "1"}
    done = subprocess.run([sys.executable, script, *argv], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def at_revision(rev: str) -> Iterator[Callable[[str, list[str]], dict[str, object]]]:
    """The tree at git revision ``rev``, built once as that revision builds itself (its
    scripts/build-native.py; pure where it has none or the build fails): a function that runs
    that revision's copy of ``script`` (a path in this tree) with ``argv`` in it and returns the
    JSON of its last line (its "build" says which build ran)."""
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, "scripts/build-native.py", "pyproject.toml"], cwd=root,
                            check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    tree = subprocess.run(["git", "archive", rev, "kvdiag", "bench", *listed], cwd=root, check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=BytesIO(tree)) as tar:
            tar.extractall(tmp, filter="data")
        env = os.environ | {"PYTHONPATH": tmp}
        built = "scripts/build-native.py" in listed and subprocess.run(
            [sys.executable, "scripts/build-native.py"], env=env, cwd=tmp, capture_output=True
        ).returncode == 0  # fmt: skip
        if not built:
            env[native.PURE_ENV] = "1"

        def run(script: str, argv: list[str]) -> dict[str, object]:
            rel = Path(script).resolve().relative_to(root)
            done = subprocess.run([sys.executable, str(Path(tmp) / rel), *argv], env=env, cwd=tmp, check=True, capture_output=True, text=True)
            return json.loads(done.stdout.strip().splitlines()[-1])

        yield run
