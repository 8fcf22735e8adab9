"""``kvdiag record``: capture engines' expositions to a recording for offline diagnosis."""

from __future__ import annotations

import argparse
import sys
import time

from rich.progress import Progress

from kvdiag.sources.recording import RecordingWriter
from kvdiag.sources.scrape import ScrapeError, scrape

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("record", help="scrape engines periodically into a .jsonl.gz recording")
    p.add_argument("targets", nargs="+", metavar="URL")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes (default 5)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds to record (default 300)")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout per scrape (s)")
    p.add_argument("--out", required=True, metavar="FILE.jsonl.gz")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.duration < 0:
        print("kvdiag record: --interval must be > 0 and --duration >= 0", file=sys.stderr)
        return EXIT_ERROR
    rounds = max(1, int(args.duration // args.interval) + 1)
    failures = 0
    start = time.monotonic()
    with RecordingWriter(args.out) as writer, Progress(disable=args.no_progress, transient=True) as progress:
        task = progress.add_task(f"recording {len(args.targets)} target(s)", total=rounds)
        for i in range(rounds):
            for target in args.targets:
                try:
                    writer.write(scrape(target, timeout=args.timeout))
                except ScrapeError as exc:
                    failures += 1
                    print(f"kvdiag record: {exc}", file=sys.stderr)
            progress.advance(task)
            if i + 1 < rounds:
                time.sleep(max(0.0, start + (i + 1) * args.interval - time.monotonic()))
        written = writer.count
    print(f"wrote {written} scrape(s) to {args.out}" + (f"; {failures} failed" if failures else ""), file=sys.stderr)
    return 0 if written else EXIT_ERROR
