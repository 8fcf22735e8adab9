"""The ``kvdiag`` command: one subcommand per module under ``kvdiag/commands``.

Each command module exposes ``add_parser(subparsers)`` and ``run(args) -> int``; the exit code
is the command's verdict where it has one (0 fine, 1 warning, 2 critical, 3 unknown/error).

A CLI reached for during an incident must answer at once, so only the command being run is
imported: its module pulls in what it needs (pandas for windows, FastAPI for the exporter, the
reference pool for simulations), and every other command is listed from ``COMMANDS`` alone.
``kvdiag --help`` imports no command module; ``tests/test_cli_startup.py`` holds that.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Sequence

from kvdiag import __version__

#: Subcommands with their one-line summaries, in the order ``kvdiag --help`` lists them.
COMMANDS: dict[str, str] = {
    "demo": "watch kvdiag read simulated SGLang and vLLM engines saturating their KV pool",
    "inspect": "show the normalized KV pool per instance, with provenance",
    "record": "scrape engines periodically, or convert saved scrape files, into a .jsonl.gz recording",
    "diagnose": "verdict per instance: does the GPU KV pool (L1) cap concurrency and drive P99 TTFT?",
    "capacity": "KV bytes per token, pool tokens and the concurrency ceiling for a model and deployment",
    "explain": "print the decision table, the checks and the thresholds in force",
    "serve": "run the exporter: scrape engines, serve /metrics, the JSON API and a landing page",
    "render": "generate rules/, dashboards/, Grafana alerting and runbooks from the checklist",
    "simulate": "run a labelled scenario on a reference SGLang/vLLM engine: serve its /metrics or record them",
    "validate": "run every scenario on both reference engines and score the verdicts against ground truth, instant by instant",
    "whatif": "replay the window through the reference engine under each remedy: predicted P99 TTFT, evictions, verdict",
}


class _Commands(argparse._SubParsersAction):
    """The subparsers action that gives each command its summary from ``COMMANDS`` (and, where
    the module sets none, its description), so a command module never repeats it."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("help", COMMANDS[name])
        kwargs.setdefault("description", COMMANDS[name][:1].upper() + COMMANDS[name][1:] + ".")
        return super().add_parser(name, **kwargs)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the command it names is built (its module imported),
    the others are listed by name and summary. Without, every command is built."""
    parser = argparse.ArgumentParser(
        prog="kvdiag",
        description="Is the GPU KV pool (L1) what caps concurrency and drives P99 TTFT? "
        "Answers from SGLang and vLLM's own Prometheus metrics.",
    )
    parser.add_argument("--version", action="version", version=f"kvdiag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", action=_Commands)
    wanted = set(COMMANDS) if argv is None else {_command(argv)}
    for name in COMMANDS:
        if name in wanted:
            module = importlib.import_module(f"kvdiag.commands.{name}")
            p = module.add_parser(sub)
            p.set_defaults(_run=module.run)
        else:
            sub.add_parser(name, add_help=False)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command named in ``argv``: the top level takes only flags, so it is the first word
    that is not one."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
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
