"""The compiled build of the reference pool (kvdiag/refpool/native.py) is the pure one, step by
step: the same per-step log, expositions, ground truth and counters on both engines; and a
source edited after the build runs as source, never as the stale extension module.

CI builds it (`make test`), so there it must be present and current; elsewhere, without a
build, the differential skips and says so.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.refpool import native
from tests.refpool.native_trace import CASES

ROOT = Path(__file__).resolve().parents[2]


def build_or_skip() -> None:
    state = native.check()
    if state.compiled:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI runs the compiled reference pool, but it is not in use: {state.reason}")
    pytest.skip(f"no compiled reference pool here ({state.reason}; scripts/build-native.py builds it)")


def traced(tmp_path: Path, pure: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    if pure:
        env[native.PURE_ENV] = "1"
    out = tmp_path / ("pure.pkl" if pure else "compiled.pkl")
    subprocess.run([sys.executable, "-m", "tests.refpool.native_trace", str(out)], cwd=ROOT, env=env, check=True, timeout=1200)
    return pickle.loads(out.read_bytes())


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    build_or_skip()
    tmp = tmp_path_factory.mktemp("native")
    return traced(tmp, pure=False), traced(tmp, pure=True)


def test_each_side_ran_its_build(traces: tuple[dict, dict]) -> None:
    compiled, pure = traces
    assert compiled["build"] == native.Build(True, "compiled")
    assert pure["build"] == native.Build(False, f"{native.PURE_ENV}=1")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'runs' if c[3] else 'steps'}")
def test_compiled_is_the_pure_build_step_by_step(traces: tuple[dict, dict], case: tuple) -> None:
    compiled, pure = (t["traces"][case] for t in traces)
    for replica, (c, p) in enumerate(zip(compiled["steps"], pure["steps"], strict=True)):
        assert c.keys() == p.keys()
        steps = len(p["start"])
        assert len(c["start"]) == steps, f"replica {replica}: {len(c['start'])} steps, pure {steps}"
        for i in range(steps):
            diff = {k: (c[k][i], p[k][i]) for k in p if c[k][i] != p[k][i]}
            assert not diff, f"replica {replica}, step {i} (t={p['start'][i]:.3f}): compiled, pure = {diff}"
    assert compiled["records"] == pure["records"]
    assert compiled["stats"] == pure["stats"]
    for n, (c_body, p_body) in enumerate(zip(compiled["bodies"], pure["bodies"], strict=True)):
        assert c_body == p_body, f"scrape {n}"


def in_copied_tree(tmp_path: Path, probe: str) -> subprocess.CompletedProcess[str]:
    """``probe`` run in a copy of the package under ``tmp_path`` (copied before the caller
    changes it), with whatever build the copy holds."""
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV} | {"PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def copy_package(tmp_path: Path) -> None:
    subprocess.run(["cp", "-r", str(ROOT / "kvdiag"), str(tmp_path / "kvdiag")], check=True)


def test_a_stale_build_runs_from_source(tmp_path: Path) -> None:
    """An edit after the build must not run the old extension module: the import falls back to
    the sources and says why."""
    build_or_skip()
    module = native.MODULES[0]
    src = native.source(module)
    copy_package(tmp_path)
    copy = tmp_path / src.relative_to(native.PACKAGE)
    copy.write_text(copy.read_text() + "\nEDITED_AFTER_THE_BUILD = True\n")
    probe = f"import {module} as m, kvdiag.refpool.native as n; print(n.BUILD.reason); print(m.__file__); print(m.EDITED_AFTER_THE_BUILD)"
    done = in_copied_tree(tmp_path, probe)
    reason, loaded, edited = done.stdout.split("\n")[:3]
    assert reason == f"stale: {src.relative_to(native.PACKAGE)} changed since the build"
    assert loaded == str(copy) and edited == "True"
    assert "runs from source" in done.stderr


def test_an_extension_module_outside_the_compiled_set_is_never_loaded(tmp_path: Path) -> None:
    """One left beside a source (a module dropped from the set since it was built) would run
    code the sources no longer hold: the import takes the source."""
    build_or_skip()
    copy_package(tmp_path)
    suffix = native.extension_modules()[0].name.split(".", 1)[1]
    compiled = tmp_path / native.source(native.MODULES[0]).relative_to(native.PACKAGE).with_suffix("." + suffix)
    outside = "kvdiag.refpool.deployments"
    assert outside not in native.MODULES
    stray = tmp_path / native.source(outside).relative_to(native.PACKAGE).with_suffix("." + suffix)
    stray.write_bytes(compiled.read_bytes())
    done = in_copied_tree(tmp_path, f"import {outside} as m, kvdiag.refpool.native as n; print(n.BUILD.reason); print(m.__file__)")
    assert done.stdout.split("\n")[:2] == ["compiled", str(stray.with_name("deployments.py"))]
