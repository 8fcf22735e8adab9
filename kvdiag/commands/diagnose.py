"""``kvdiag diagnose``: is the GPU KV pool what caps concurrency? One answer per instance.

Sources: engine URLs (sampled every ``--interval`` for ``--duration``), recordings
(``--replay``), saved exposition files (point-in-time answers), or a Prometheus server
(``--prometheus``, a past window through query_range). Whatever the source, samples go
through the same adapters, windows and checks. Exit code: the worst verdict over instances
(0 healthy / near capacity, 1 warning, 2 L1 bottleneck, 3 unknown or error).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import Progress

from kvdiag import config as cfg
from kvdiag.checks import diagnose_all, exit_code, undiagnosable
from kvdiag.engines import TooManyInstances, UnknownEngine, normalize_scrape
from kvdiag.exposition import ExpositionError
from kvdiag.model import PoolSample, Scrape
from kvdiag.quantity import INTERVAL, SAMPLING, SINCE, STEP, TIMEOUT
from kvdiag.report import diagnosis as terminal
from kvdiag.report.json import dumps, report_json
from kvdiag.report.output import check_writable
from kvdiag.sources.inputs import is_url
from kvdiag.sources.logs import LogStream, add_log_arguments, open_logs
from kvdiag.sources.prometheus import PrometheusError, read_window
from kvdiag.sources.recording import RecordingError, read_recording
from kvdiag.sources.scrape import ScrapeError, redact, scrape
from kvdiag.sources.series import read_files
from kvdiag.window import windows

EXIT_ERROR = 3
FOLLOW_EVERY_S = 5.0  # log seconds between re-diagnoses while following
#: A URL that fails this many first scrapes (never answering) is given up on and reported.
GIVE_UP_AFTER = 2


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "diagnose",
        description="Exit code: 0 healthy or near capacity, 1 warning, 2 L1 bottleneck, 3 unknown or error (worst over instances).",
    )
    add_source_arguments(p)
    add_threshold_arguments(p)
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while sampling")
    return p


def add_threshold_arguments(p: argparse.ArgumentParser) -> None:
    """The checks' thresholds (``thresholds`` reads these): shared by diagnose and whatif."""
    p.add_argument("--config", metavar="YAML", help="thresholds file (its 'checks:' section)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a threshold (see `kvdiag explain`)")
    p.add_argument("--window", metavar="DURATION", help="the checks' window (default 5m)")
    p.add_argument("--ttft-slo", metavar="DURATION", help="the TTFT SLO (default 10s)")


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """Where the samples come from (``collect`` reads these): shared by diagnose and whatif."""
    p.add_argument("inputs", nargs="*", metavar="URL|FILE", help="engine URL (sampled), saved exposition file, or recording")
    p.add_argument("--replay", action="append", metavar="REC", help="a recording (.jsonl.gz) made by `kvdiag record`")
    p.add_argument("--prometheus", metavar="URL", help="read a past window from this Prometheus server (query_range)")
    p.add_argument("--selector", default="", metavar="'{job=\"...\"}'", help="label matchers for --prometheus")
    p.add_argument("--since", default="1h", metavar="DURATION", help="how far back --prometheus reads (default 1h)")
    p.add_argument("--step", metavar="DURATION", help="query_range step (default: about 720 points over --since)")
    p.add_argument("--interval", default="5s", metavar="DURATION", help="seconds between scrapes of engine URLs (default 5s)")
    p.add_argument("--duration", default="60s", metavar="DURATION", help="how long to sample engine URLs (default 60s)")
    p.add_argument("--timeout", default="10s", metavar="DURATION", help="deadline of each scrape, connect to last byte (default 10s)")
    p.add_argument("--engine", default="auto", choices=("auto", "sglang", "vllm"), help="expect this engine (default: detect)")
    add_log_arguments(p)


@dataclass
class Collected:
    """Samples from all sources, and the targets that yielded none (with why)."""

    samples: list[PoolSample] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)  # targets that yielded samples
    when: float = field(default_factory=time.time)
    logs: list[LogStream] = field(default_factory=list)  # read in full, or followed by follow()

    def add(self, s: Scrape, engine: str) -> None:
        """Normalize one scrape; whatever goes wrong with it is this target's problem line,
        never the end of a multi-target run (a kvdiag bug says so, with its type)."""
        try:
            self.samples.extend(normalize_scrape(s, engine))
            self.answered.add(s.target)
        except (UnknownEngine, ExpositionError, TooManyInstances) as exc:
            self.problems.setdefault(s.target, str(exc))
        except Exception as exc:  # noqa: BLE001 (contained per target, and named)
            self.problems.setdefault(s.target, f"internal error reading this target: {type(exc).__name__}: {exc}")

    def settle(self) -> None:
        """A target that yielded samples at other moments is not a problem (a failed scrape
        among good ones only thins its window)."""
        self.problems = {t: why for t, why in self.problems.items() if t not in self.answered}


def run(args: argparse.Namespace) -> int:
    try:
        if args.html:
            check_writable(args.html, "--html")
        config = thresholds(args)
        collected = collect(args)
    except (cfg.ConfigError, ValueError, OSError, RecordingError, PrometheusError) as exc:
        print(f"kvdiag diagnose: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if collected is None:
        return EXIT_ERROR
    if args.follow:
        follow(collected, config, args)
    by_instance = windows(collected.samples)
    diagnoses = diagnose_all(by_instance.values(), config)
    diagnoses += [undiagnosable(t, why, collected.when) for t, why in collected.problems.items()]
    code = exit_code(diagnoses)
    for log in collected.logs:
        for line in log.report.describe():
            print(f"kvdiag diagnose: {line}", file=sys.stderr)
    if args.json:
        print(dumps(report_json(diagnoses, code), indent=2))
    else:
        terminal.render(Console(), diagnoses)
    if args.html:
        from kvdiag.report.html import write_report

        write_report(args.html, diagnoses, by_instance, config)
        if not args.json:
            print(f"wrote {args.html}", file=sys.stderr)
    return code


def collect(args: argparse.Namespace) -> Collected | None:
    """Samples from whichever sources the arguments name; None after printing a usage error."""
    if not (args.inputs or args.replay or args.prometheus or args.log):
        print("kvdiag diagnose: give engine URLs, files, --replay REC, --log FILE or --prometheus URL", file=sys.stderr)
        return None
    out = Collected()
    out.logs = open_logs(args)
    if not args.follow:
        for log in out.logs:
            out.samples.extend(log)
            if not log.report.samples:
                out.problems[log.report.name] = "no engine stats lines in this log"
    if args.prometheus:
        res = read_window(
            args.prometheus,
            args.selector,
            SINCE.parse(args.since, "--since"),
            STEP.parse(args.step, "--step") if args.step else None,
            engine=args.engine,
            timeout=max(TIMEOUT.parse(args.timeout, "--timeout"), 30.0),
        )
        out.samples.extend(res.samples)
        out.problems.update(res.problems)
        out.when = res.end
    for path in args.replay or []:
        for s in read_recording(path):
            out.add(s, args.engine)
    urls = [a for a in args.inputs if is_url(a)]
    for s in read_files([a for a in args.inputs if not is_url(a)], lambda line: print(f"kvdiag {args.command}: {line}", file=sys.stderr)):
        out.add(s, args.engine)
    if urls:
        sample_urls(urls, args, out)
    out.settle()
    return out


def follow(out: Collected, config: cfg.Config, args: argparse.Namespace) -> None:
    """``--log FILE --follow``: re-diagnose as lines arrive, printing each instance's verdict
    when it changes, until Ctrl-C or ``--follow-timeout``. Diagnoses are spaced by log time
    (``FOLLOW_EVERY_S``), so replaying a long log costs what scraping it live would."""
    console = Console(stderr=args.json, soft_wrap=True)
    shown: dict[str, str] = {}
    last = -float("inf")
    try:
        for sample in out.logs[0]:
            out.samples.append(sample)
            if sample.ts - last < FOLLOW_EVERY_S:
                continue
            last = sample.ts
            out.samples = [s for s in out.samples if s.ts >= last - config.window]  # memory stays flat
            for d in diagnose_all(windows(out.samples).values(), config):
                if shown.get(d.instance) != d.verdict.name:
                    shown[d.instance] = d.verdict.name
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.end))
                    console.print(f"{stamp} {d.instance}: {d.verdict.name} ({d.verdict.reason})", highlight=False)
    except KeyboardInterrupt:
        pass


def sample_urls(urls: list[str], args: argparse.Namespace, out: Collected) -> None:
    """Scrape each URL every --interval for --duration (at least once), with a progress bar
    that counts failed scrapes. A URL that fails its first GIVE_UP_AFTER scrapes without ever
    answering is reported at once (one line, its reason) and no longer sampled; when no URL is
    left, sampling stops there instead of waiting out --duration."""
    interval, duration = INTERVAL.parse(args.interval, "--interval"), SAMPLING.parse(args.duration, "--duration")
    timeout = TIMEOUT.parse(args.timeout, "--timeout")
    rounds = int(duration // interval) + 1
    start = time.monotonic()
    failures: dict[str, int] = {}
    active = list(urls)
    label = f"sampling {len(urls)} engine(s) every {interval:g}s"
    with Progress(disable=args.no_progress or args.json, transient=True) as progress:
        task = progress.add_task(label, total=rounds)
        for i in range(rounds):
            for url in list(active):
                target = redact(url)  # what the scrape names it by: never its credentials
                try:
                    out.add(scrape(url, timeout=timeout), args.engine)
                    continue
                except ScrapeError as exc:
                    out.problems.setdefault(target, str(exc))
                failures[target] = failures.get(target, 0) + 1
                if target not in out.answered and failures[target] >= GIVE_UP_AFTER:
                    active.remove(url)
                    print(f"kvdiag diagnose: giving up on {target} after {failures[target]} failed scrapes: {out.problems[target]}", file=sys.stderr)
            failed = sum(failures.values())
            progress.update(task, advance=1, description=label + (f" · {failed} failed scrape(s)" if failed else ""))
            if not active:
                break
            if i + 1 < rounds:
                time.sleep(max(0.0, start + (i + 1) * interval - time.monotonic()))


def thresholds(args: argparse.Namespace) -> cfg.Config:
    overrides = list(args.set)
    if args.window:
        overrides.append(f"window={args.window}")
    if args.ttft_slo:
        overrides.append(f"ttft_slo={args.ttft_slo}")
    return cfg.resolve(args.config, overrides)

