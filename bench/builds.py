"""Baselines in one bench run: the reference pool's pure build, and the tree of another revision.

The compiled build runs in this process, the pure one (``KVDIAG_PURE=1``,
kvdiag/refpool/native.py) in a child running the same bench script: a process runs one build
for good (the compiled modules are imported once). Another revision's tree (``git archive``
into a temporary directory, first on the child's path) runs its own copy of the script, pure
(a tree from git holds no compiled modules), so a speed-up is measured against the code it
replaces on the same machine in the same minutes, not against a figure from another day. Either
child prints its figures as JSON on its last line, which is returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from kvdiag.refpool import native


def this_build() -> str:
    return native.install().reason


def in_pure_build(script: str, argv: list[str]) -> dict[str, object]:
    env = os.environ | {native.PURE_ENV: "1"}
    done = subprocess.run([sys.executable, script, *argv], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def at_revision(rev: str, script: str, argv: list[str]) -> dict[str, object]:
    """``script`` (a path in this tree) as it is at git revision ``rev``, run in that revision's
    tree with ``argv``, pure."""
    root = Path(__file__).resolve().parents[1]
    rel = Path(script).resolve().relative_to(root)
    tree = subprocess.run(["git", "archive", rev, "kvdiag", "bench"], cwd=root, check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=BytesIO(tree)) as tar:
            tar.extractall(tmp, filter="data")
        env = os.environ | {native.PURE_ENV: "1", "PYTHONPATH": tmp}
        done = subprocess.run([sys.executable, str(Path(tmp) / rel), *argv], env=env, cwd=tmp, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
