"""The reference pool's two builds in one bench run: the compiled one in this process, the pure
one (``KVDIAG_PURE=1``, kvdiag/refpool/native.py) in a child running the same bench script.

A process runs one build for good (the compiled modules are imported once), so the baseline
build is a second process: the script, re-run with ``argv`` and the pure build forced, prints
its figures as JSON on its last line, which is returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvdiag.refpool import native


def this_build() -> str:
    return native.install().reason


def in_pure_build(script: str, argv: list[str]) -> dict[str, object]:
    env = os.environ | {native.PURE_ENV: "1"}
    done = subprocess.run([sys.executable, script, *argv], env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
