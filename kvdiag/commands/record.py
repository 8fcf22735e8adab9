"""``kvdiag record``: capture engines' expositions to a recording for offline diagnosis, or
convert saved scrape files (a folder of them) into one, timed as ``diagnose`` times them."""

from __future__ import annotations

import argparse
import sys
import time

from rich.progress import Progress

from kvdiag.quantity import INTERVAL, SAMPLING, TIMEOUT
from kvdiag.sources.inputs import is_url
from kvdiag.sources.recording import RecordingWriter, write_recording
from kvdiag.sources.scrape import ScrapeError, scrape
from kvdiag.sources.series import read_files

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("record")
    p.add_argument("targets", nargs="+", metavar="URL|FILE|DIR", help="engine URLs to scrape, or saved scrape files / folders to convert")
    p.add_argument("--interval", default="5s", metavar="DURATION", help="time between scrapes (default 5s)")
    p.add_argument("--duration", default="300s", metavar="DURATION", help="how long to record (default 300s)")
    p.add_argument("--timeout", default="10s", metavar="DURATION", help="deadline of each scrape, connect to last byte (default 10s)")
    p.add_argument("--out", required=True, metavar="FILE.jsonl.gz")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    return p


def run(args: argparse.Namespace) -> int:
    files = [t for t in args.targets if not is_url(t)]
    if files:
        if len(files) < len(args.targets):
            print("kvdiag record: give engine URLs to record, or saved scrape files to convert, not both", file=sys.stderr)
            return EXIT_ERROR
        return convert(files, args.out)
    try:
        interval = INTERVAL.parse(args.interval, "--interval")
        duration = SAMPLING.parse(args.duration, "--duration")
        timeout = TIMEOUT.parse(args.timeout, "--timeout")
    except ValueError as exc:
        print(f"kvdiag record: {exc}", file=sys.stderr)
        return EXIT_ERROR
    rounds = max(1, int(duration // interval) + 1)
    failures = 0
    start = time.monotonic()
    try:
        writer = RecordingWriter(args.out)
    except OSError as exc:
        print(f"kvdiag record: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    with writer, Progress(disable=args.no_progress, transient=True) as progress:
        task = progress.add_task(f"recording {len(args.targets)} target(s)", total=rounds)
        for i in range(rounds):
            for target in args.targets:
                try:
                    writer.write(scrape(target, timeout=timeout))
                except ScrapeError as exc:
                    failures += 1
                    print(f"kvdiag record: {exc}", file=sys.stderr)
            progress.advance(task)
            if i + 1 < rounds:
                time.sleep(max(0.0, start + (i + 1) * interval - time.monotonic()))
        written = writer.count
    print(f"wrote {written} scrape(s) to {args.out}" + (f"; {failures} failed" if failures else ""), file=sys.stderr)
    return 0 if written else EXIT_ERROR


def convert(paths: list[str], out: str) -> int:
    """Saved scrape files (or folders of them) into one recording, each series timed and
    ordered as diagnose reads it (said on stderr)."""
    try:
        scrapes = list(read_files(paths, lambda line: print(f"kvdiag record: {line}", file=sys.stderr)))
        written = write_recording(out, scrapes)
    except (ValueError, OSError) as exc:
        print(f"kvdiag record: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {written} scrape(s) to {out}", file=sys.stderr)
    return 0
