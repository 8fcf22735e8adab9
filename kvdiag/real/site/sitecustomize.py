"""Imported at start-up by every Python process of a real engine that kvdiag's harness launches
(``kvdiag/real/site`` is first on its ``PYTHONPATH``; vLLM's engine core and SGLang's scheduler
run in child processes, which inherit it). It must not import kvdiag: the engine's environment
does not hold it. Two jobs, each armed only by its trigger, neither changing what the engine does:

* torchvision's operator schemas. SGLang imports ``torchvision.transforms`` at top level; PyPI's
  torchvision 0.28.0 is a CUDA build whose operators never register beside the CPU torch, and its
  ``_meta_registrations`` registers fakes for ``torchvision::nms`` / ``qnms`` unguarded, which
  fails on an undefined operator. The two schemas (no kernels) are defined just before
  torchvision's first import; a text model never calls them.
* the truth hook (``kvdiag_truth``), when ``KVDIAG_TRUTH_FILE`` names the file to append to: it
  observes the scheduler's own admission decisions once the scheduler module is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Callable

_KEEP: list[object] = []  # torch.library.Library objects: a collected one drops its definitions


def _torchvision_schemas() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            getattr(torch.ops.torchvision, op)
        except (AttributeError, RuntimeError):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)


class _Hooks(importlib.abc.MetaPathFinder):
    """Runs ``before[name]()`` just before a module's first import and ``after[name](module)``
    just after it executes; other imports pass through untouched."""

    def __init__(self) -> None:
        self.before: dict[str, Callable[[], None]] = {}
        self.after: dict[str, Callable[[object], None]] = {}

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name in self.before:
            self.before.pop(name)()
        if name not in self.after:
            return None
        callback = self.after.pop(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            execute(module)
            callback(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    hooks = _Hooks()
    hooks.before["torchvision"] = _torchvision_schemas
    if os.environ.get("KVDIAG_TRUTH_FILE"):
        import kvdiag_truth

        hooks.after.update(kvdiag_truth.HOOKS)
    sys.meta_path.insert(0, hooks)


_install()
