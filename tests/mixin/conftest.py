"""Helpers for the mixin tests: the repository root (where the generated files are committed)
and the system binaries they run (promtool, prometheus)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def need(binary: str) -> str:
    """The path of a system binary the test needs; a clear skip (a failure under CI) if absent."""
    path = shutil.which(binary)
    if path is None:
        msg = f"{binary} is not installed (`make system-deps` installs it from Debian)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path
