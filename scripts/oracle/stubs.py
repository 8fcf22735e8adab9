"""Permissive stand-ins for modules the engines import at top level but that take no part in
admission, retraction or KV accounting (see each driver's docstring for its list).

A stand-in module answers any attribute with a ``Stub``: callable (as a decorator it returns
the function it decorates), subscriptable, usable in ``|`` type unions and as a base class, so
module bodies that define kernels, CLI servers or process titles import, and any real use of
them would fail loudly in the driver rather than silently change scheduling.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # bare decorator: keep the function
        if args or kwargs:
            return Stub  # a decorator with arguments, or a type built with arguments
        raise RuntimeError(f"stand-in {cls.__name__} called: this module is stubbed")

    def __getitem__(cls, item: Any) -> Any:
        return Stub

    def __or__(cls, other: Any) -> Any:
        return Stub

    __ror__ = __or__

    def __iter__(cls) -> Any:
        return iter(())


class Stub(metaclass=_StubMeta):
    """Any name of a stand-in module."""


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(roots: tuple[str, ...]) -> None:
    """Serve ``roots`` (and every submodule) from stand-ins, ahead of the real import system.

    transformers caches whether torchvision is installed, and torch's compiler whether triton
    is: both are asked before the stand-ins exist, so that they answer no and never use them.
    """
    import torch._inductor.compile_fx  # noqa: F401  (imports its triton fallbacks now)
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    for name in list(sys.modules):
        if name.split(".")[0] in roots:
            del sys.modules[name]
    sys.meta_path.insert(0, _StubFinder(roots))
