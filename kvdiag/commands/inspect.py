"""``kvdiag inspect``: the normalized pool of every instance, and where each number came from."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from kvdiag.engines import UnknownEngine, normalize_scrape
from kvdiag.exposition import ExpositionError
from kvdiag.model import PoolSample
from kvdiag.report.terminal import inspect_table, provenance_table
from kvdiag.sources.inputs import read_inputs
from kvdiag.sources.recording import RecordingError
from kvdiag.sources.scrape import ScrapeError

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="show the normalized KV pool per instance, with provenance")
    p.add_argument("inputs", nargs="*", metavar="URL|FILE", help="engine URL, saved exposition file or recording")
    p.add_argument("--replay", action="append", metavar="REC", help="a recording (.jsonl.gz) made by `kvdiag record`")
    p.add_argument("--engine", default="auto", choices=("auto", "sglang", "vllm"), help="expect this engine (default: detect)")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout per scrape (s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--provenance", action="store_true", help="also print where every field came from")
    return p


def sample_json(sample: PoolSample) -> dict:
    """The documented ``inspect --json`` shape for one instance (plus a few more keys)."""
    hit = None
    if sample.prefix_hit_tokens_total is not None and sample.prefix_query_tokens_total:
        hit = sample.prefix_hit_tokens_total / sample.prefix_query_tokens_total
    elif sample.prefix_hit_ratio_gauge is not None:
        hit = sample.prefix_hit_ratio_gauge
    return {
        "instance": sample.instance,
        "engine": sample.engine,
        "model": sample.model,
        "ts": sample.ts,
        "kv_usage": sample.usage_ratio,
        "usage_granularity": sample.usage_granularity,
        "capacity_tokens": _int(sample.capacity_tokens),
        "used_tokens": _int(sample.used_tokens),
        "evictable_tokens": _int(sample.evictable_tokens),
        "available_tokens": _int(sample.available_tokens),
        "running": sample.running,
        "waiting": sample.waiting,
        "evictions_total": sample.evictions_total,
        "prefix_hit_ratio": hit,
        "l2_used_tokens": _int(sample.l2_used_tokens),
        "l2_capacity_tokens": _int(sample.l2_capacity_tokens),
        "ttft_observations": sample.ttft.count if sample.ttft else None,
        "provenance": {k: v.describe() for k, v in sample.provenance.items()},
        "notes": sample.notes,
    }


def _int(v: float | None) -> int | None:
    return None if v is None else int(round(v))


def run(args: argparse.Namespace) -> int:
    if not args.inputs and not args.replay:
        print("kvdiag inspect: give an engine URL, an exposition file or --replay REC", file=sys.stderr)
        return EXIT_ERROR
    latest: dict[str, PoolSample] = {}
    counts: dict[str, int] = {}
    recorded = bool(args.replay)
    try:
        for scrape in read_inputs(args.inputs, args.replay, args.timeout):
            for s in normalize_scrape(scrape, args.engine):
                latest[s.instance] = s if s.instance not in latest or s.ts >= latest[s.instance].ts else latest[s.instance]
                counts[s.instance] = counts.get(s.instance, 0) + 1
                recorded = recorded or counts[s.instance] > 1
    except (ExpositionError, UnknownEngine, ScrapeError, RecordingError, OSError, ValueError) as exc:
        print(f"kvdiag inspect: {exc}", file=sys.stderr)
        return EXIT_ERROR
    samples = list(latest.values())
    if args.json:
        out = []
        for s in samples:
            d = sample_json(s)
            if recorded:
                d["samples"] = counts[s.instance]
            out.append(d)
        print(json.dumps({"instances": out}, indent=2))
        return 0
    console = Console()
    console.print(inspect_table(samples))
    for s in samples:
        for note in s.notes:
            console.print(f"[yellow]note[/yellow] {s.instance}: {note}")
        if args.provenance:
            console.print(provenance_table(s))
    return 0
