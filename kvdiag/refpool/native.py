"""The reference pool's compiled build: the same sources, compiled to C extensions by mypyc.

`kvdiag whatif` replays an hour of an incident once per remedy through the reference engines;
their per-request and per-step Python (radix walks, slot and block bookkeeping, the engine loop)
is what bounds it. mypyc compiles those modules as they are, so the ``.py`` files stay the one
reference: there is no second implementation to keep equal, and ``tests/refpool/test_native.py``
holds the compiled build equal to the pure one, step by step.

``scripts/build-native.py`` (run by ``make demo`` / ``make test``) writes an extension module
beside each source in ``MODULES`` and a manifest (``native.json``) with each source's digest.
An extension module shadows its source, so an edit after the build would run the old code
silently: ``install()``, called before any of these modules is imported, loads every one of them
from source instead when a source differs from its digest (saying so once, on stderr), when
``KVDIAG_PURE=1`` asks for the pure build, or when there is no build. It is all or none: the
compiled modules call each other inside one shared library, not through their Python modules.
An extension module left beside a source outside the compiled set (built when the set was
larger) is never loaded either.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Sequence

PACKAGE = Path(__file__).resolve().parent.parent.parent  # the directory holding ``kvdiag/``
MANIFEST = Path(__file__).with_name("native.json")
PURE_ENV = "KVDIAG_PURE"
GROUP = "kvdiag.refpool._native"  # the shared library's module name (mypyc's group name)

# The compiled set: what a replay spends its time in (bench/bench_whatif.py's profile).
MODULES: tuple[str, ...] = (
    "kvdiag.refpool.emit",
    "kvdiag.refpool.roofline",
    "kvdiag.refpool.sim",
    "kvdiag.refpool.types",
    "kvdiag.refpool.workload",
    "kvdiag.refpool.vllm.batch_decode",
    "kvdiag.refpool.vllm.block_pool",
    "kvdiag.refpool.vllm.kv_cache_manager",
    "kvdiag.refpool.vllm.offload",
    "kvdiag.refpool.vllm.request",
    "kvdiag.refpool.vllm.scheduler",
    "kvdiag.refpool.sglang.allocator",
    "kvdiag.refpool.sglang.fast_forward",
    "kvdiag.refpool.sglang.hicache",
    "kvdiag.refpool.sglang.invariants",
    "kvdiag.refpool.sglang.prefill_budget",
    "kvdiag.refpool.sglang.radix_cache",
    "kvdiag.refpool.sglang.schedule_batch",
    "kvdiag.refpool.sglang.scheduler",
    "kvdiag.refpool.sglang.stats",
)


@dataclass(frozen=True)
class Build:
    """Which build this process runs, and why."""

    compiled: bool
    reason: str  # "compiled", or why the sources run instead


def source(module: str) -> Path:
    return PACKAGE.joinpath(*module.split(".")).with_suffix(".py")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check() -> Build:
    """Whether the compiled build may run: asked for, present, and built from these sources."""
    if os.environ.get(PURE_ENV) == "1":
        return Build(False, f"{PURE_ENV}=1")
    if not MANIFEST.exists():
        return Build(False, "not built (scripts/build-native.py)")
    try:
        built = json.loads(MANIFEST.read_text())
    except (OSError, ValueError) as e:
        return Build(False, f"unreadable {MANIFEST.name}: {e}")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    if built.get("suffix") != suffix or built.get("modules", {}).keys() != set(MODULES):
        return Build(False, f"built for another interpreter or module set ({built.get('suffix')})")
    for module in (*MODULES, GROUP + "__mypyc"):
        if not source(module).with_suffix(suffix).exists():
            return Build(False, f"{module}: extension module missing")
    for module in MODULES:
        if digest(source(module)) != built["modules"][module]:
            return Build(False, f"stale: {source(module).relative_to(PACKAGE)} changed since the build")
    return Build(True, "compiled")


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled set's modules as sources, ahead of their extension modules."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, source(fullname))


def extension_modules() -> list[Path]:
    """The extension modules on disk beside the reference pool's sources, built or left over."""
    return sorted(Path(__file__).parent.rglob("*" + importlib.machinery.EXTENSION_SUFFIXES[0]))


def strays() -> dict[str, Path]:
    """Extension modules on disk for modules outside the compiled set, by module name."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    on_disk = {".".join(p.relative_to(PACKAGE).parts)[: -len(suffix)]: p for p in extension_modules()}
    return {m: p for m, p in on_disk.items() if m not in MODULES and m != GROUP + "__mypyc"}


BUILD: Build | None = None  # this process's, once installed


def install() -> Build:
    """Decide this process's build once, before the compiled set is imported."""
    global BUILD
    if BUILD is None:
        BUILD = check()
        sources = set(strays()) | (set() if BUILD.compiled else set(MODULES))
        if sources:
            sys.meta_path.insert(0, _SourceFinder(sorted(sources)))
        if not BUILD.compiled:
            if BUILD.reason.startswith("stale"):
                print(f"kvdiag: the reference pool runs from source ({BUILD.reason}; make rebuilds it)", file=sys.stderr)
    return BUILD


def digests() -> dict[str, str]:
    """Each compiled module's source digest, by module name."""
    return {m: digest(source(m)) for m in MODULES}


def write_manifest(modules: dict[str, str]) -> None:
    """Record the sources the extension modules were built from (``digests()`` taken before the
    compile, so that a source saved during it reads as stale, never as built)."""
    MANIFEST.write_text(json.dumps({"suffix": importlib.machinery.EXTENSION_SUFFIXES[0], "modules": modules}, indent=1) + "\n")
