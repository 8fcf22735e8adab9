"""``kvdiag inspect``: the normalized pool of every instance, and where each number came from."""

from __future__ import annotations

import argparse
import sys
from typing import Iterable

from rich.console import Console
from rich.live import Live

from kvdiag.engines import UnknownEngine, normalize_scrape
from kvdiag.exposition import ExpositionError
from kvdiag.model import PoolSample
from kvdiag.report.terminal import Fitted, inspect_table, provenance_table
from kvdiag.quantity import TIMEOUT
from kvdiag.sources.inputs import read_inputs
from kvdiag.sources.logs import LogStream, add_log_arguments, open_logs
from kvdiag.sources.recording import RecordingError
from kvdiag.sources.scrape import ScrapeError
from kvdiag.report.json import dumps
from kvdiag.report.samples import sample_json

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect")
    p.add_argument("inputs", nargs="*", metavar="URL|FILE", help="engine URL, saved exposition file or recording")
    p.add_argument("--replay", action="append", metavar="REC", help="a recording (.jsonl.gz) made by `kvdiag record`")
    p.add_argument("--engine", default="auto", choices=("auto", "sglang", "vllm"), help="expect this engine (default: detect)")
    p.add_argument("--timeout", default="10s", metavar="DURATION", help="deadline of each scrape, connect to last byte (default 10s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--provenance", action="store_true", help="also print where every field came from")
    add_log_arguments(p)
    return p


class Latest:
    """The newest sample per instance and how many each had (one scrape, or a series)."""

    def __init__(self) -> None:
        self.samples: dict[str, PoolSample] = {}
        self.counts: dict[str, int] = {}

    def add(self, s: PoolSample) -> None:
        old = self.samples.get(s.instance)
        if old is None or s.ts >= old.ts:
            self.samples[s.instance] = s
        self.counts[s.instance] = self.counts.get(s.instance, 0) + 1

    def series(self) -> bool:
        return any(n > 1 for n in self.counts.values())


def run(args: argparse.Namespace) -> int:
    if not args.inputs and not args.replay and not args.log:
        print("kvdiag inspect: give an engine URL, an exposition file, --replay REC or --log FILE", file=sys.stderr)
        return EXIT_ERROR
    latest = Latest()
    try:
        streams = open_logs(args)
        if args.follow:
            return _follow(args, streams[0], latest)
        for scrape in read_inputs(args.inputs, args.replay, TIMEOUT.parse(args.timeout, "--timeout"), lambda line: print(f"kvdiag inspect: {line}", file=sys.stderr)):
            for s in normalize_scrape(scrape, args.engine):
                latest.add(s)
        for stream in streams:
            for s in stream:
                latest.add(s)
    except (ExpositionError, UnknownEngine, ScrapeError, RecordingError, OSError, ValueError) as exc:
        print(f"kvdiag inspect: {exc}", file=sys.stderr)
        return EXIT_ERROR
    _report_logs(streams)
    if not latest.samples:
        print("kvdiag inspect: no SGLang or vLLM stats lines in " + ", ".join(s.report.name for s in streams), file=sys.stderr)
        return EXIT_ERROR
    recorded = bool(args.replay) or latest.series()
    if args.json:
        out = []
        for s in latest.samples.values():
            d = sample_json(s)
            if recorded:
                d["samples"] = latest.counts[s.instance]
            out.append(d)
        doc: dict = {"instances": out}
        if streams:
            doc["logs"] = [s.report.as_dict() for s in streams]
        print(dumps(doc, indent=2))
        return 0
    _print_tables(Console(), latest.samples.values(), args.provenance)
    return 0


def _print_tables(console: Console, samples: Iterable[PoolSample], provenance: bool) -> None:
    samples = list(samples)
    console.print(inspect_table(samples))
    for s in samples:
        for note in s.notes:
            console.print(f"[yellow]note[/yellow] {s.instance}: {note}")
        if provenance:
            console.print(provenance_table(s))


def _report_logs(streams: list[LogStream]) -> None:
    """What each log held, on stderr, when a line did not parse or nothing was found."""
    for stream in streams:
        if stream.report.unparsed or not stream.report.samples:
            print("\n".join(stream.report.describe()), file=sys.stderr)


class _LiveTable:
    """The table, built when rich redraws (twice a second), not once per sample: a burst of
    lines costs nothing and the screen never lags the last one."""

    def __init__(self, latest: Latest) -> None:
        self.latest = latest

    def __rich__(self) -> Fitted:
        return inspect_table(list(self.latest.samples.values()))


def _follow(args: argparse.Namespace, stream: LogStream, latest: Latest) -> int:
    """tail -f: the table redrawn as lines arrive (JSON Lines with --json) until Ctrl-C or
    --follow-timeout; the last state is printed at the end."""
    console = Console()
    try:
        if args.json:
            for s in stream:
                latest.add(s)
                print(dumps(sample_json(s)), flush=True)
        else:
            with Live(_LiveTable(latest), console=console, refresh_per_second=2, transient=True):
                for s in stream:
                    latest.add(s)
    except KeyboardInterrupt:
        stream.close()
    _report_logs([stream])
    if not args.json and latest.samples:
        _print_tables(console, latest.samples.values(), args.provenance)
    return 0
