"""The ``kvdiag`` command: one subcommand per module under ``kvdiag/commands``.

Each command module exposes ``add_parser(subparsers)`` and ``run(args) -> int``; the exit code
is the command's verdict where it has one (0 fine, 1 warning, 2 critical, 3 unknown/error).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvdiag import __version__

#: Subcommands, in the order ``kvdiag --help`` lists them.
COMMANDS = ("demo", "inspect", "record", "diagnose", "capacity", "explain", "serve", "render", "simulate", "validate", "whatif")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdiag",
        description="Is the GPU KV pool (L1) what caps concurrency and drives P99 TTFT? "
        "Answers from SGLang and vLLM's own Prometheus metrics.",
    )
    parser.add_argument("--version", action="version", version=f"kvdiag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"kvdiag.commands.{name}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 3
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of our output went away (``kvdiag inspect --json | head``): stop quietly, as
    a Unix filter does, with the shell's code for SIGPIPE. stdout is pointed at /dev/null so
    that Python's own flush at exit does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured)
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
