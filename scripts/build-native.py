"""Build the reference pool's compiled build (kvdiag/refpool/native.py says why and what).

Compiles ``native.MODULES`` with mypyc into extension modules beside their sources (C files and
objects under .cache/native-build), then writes the manifest of the sources they came from.
Does nothing when the build on disk is current, so ``make`` runs it every time. Needs mypy (the
``native`` extra), a C compiler and the interpreter's headers; exits 1 with the compiler's words
when any is missing, and the reference pool then runs from source.

Usage: .venv/bin/python scripts/build-native.py [--force]
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from kvdiag.refpool import native

BUILD_DIR = Path(".cache/native-build")


def build() -> None:
    from mypyc.build import mypycify  # the build needs mypy; kvdiag at run time does not
    from setuptools import setup

    paths = [str(native.source(m).relative_to(native.PACKAGE)) for m in native.MODULES]
    native.MANIFEST.unlink(missing_ok=True)
    shutil.rmtree(native.PACKAGE / BUILD_DIR, ignore_errors=True)  # objects built with other flags are not reused
    for old in native.extension_modules():  # a module left out of the set runs from source again
        old.unlink()
    os.chdir(native.PACKAGE)
    extensions = mypycify(paths, opt_level="3", group_name=native.GROUP, target_dir=str(BUILD_DIR / "c"))
    setup(
        name="kvdiag-native",
        ext_modules=extensions,
        script_args=["-q", "build_ext", "--inplace", "--build-temp", str(BUILD_DIR / "obj"), "--build-lib", str(BUILD_DIR / "lib")],
    )


def main(argv: list[str]) -> int:
    state = native.check()
    for stray in native.strays().values():  # left from a larger compiled set: never loaded, gone
        stray.unlink()
    if state.compiled and "--force" not in argv:
        return 0
    print(f"build-native: compiling the reference pool ({state.reason})", file=sys.stderr)
    sources = native.digests()
    try:
        build()
    except (SystemExit, Exception) as e:  # setuptools reports a compiler failure as SystemExit
        print(f"build-native: failed ({e}); the reference pool runs from source", file=sys.stderr)
        return 1
    native.write_manifest(sources)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
