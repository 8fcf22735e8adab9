"""Log source throughput and memory: a generated server log streamed through ``read_log``.

Usage: .venv/bin/python bench/bench_logs.py [--size-mb 1024] [--dir DIR] [--no-json-file]

The log (written to a temporary directory, streamed to disk, deleted afterwards) interleaves,
per logged second: SGLang Decode and Prefill lines of two DP replicas with TP prefixes, a retract
warning printed by two TP ranks, uvicorn access lines, and vLLM stats lines of two engines, so
about half its lines are engine stats (the parser's expensive path). Peak RSS is read at 10 %,
50 % and 100 % of the lines: a flat high-water mark is what constant memory looks like.
The same lines are then parsed as docker's json-file driver writes them (one JSON record a line,
each with its ``time``), and their rate is given as a ratio to the plain log's in this run.
Last line: JSON with ``lines_per_second``, ``max_rss_mib`` and ``json_file`` (its lines/s, peak
RSS and ``vs_plain``).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from kvdiag.sources.logs import LogReport, read_log

#: One logged second; {s} is SGLang's stamp, {v} vLLM's, {i} varies the numbers a little.
SECOND = "".join(
    line + "\n"
    for line in (
        "[{s} DP0 TP0] Decode batch, #running-req: 4{i}, #token: 19070{i}, token usage: 0.9{i}, cuda graph: True, "
        "gen throughput (token/s): 1389.42, #queue-req: 3{i}",
        "[{s} DP1 TP0] Decode batch, #running-req: 5{i}, #token: 18070{i}, token usage: 0.8{i}, cuda graph: True, "
        "gen throughput (token/s): 1289.42, #queue-req: 2{i}",
        '[{s}] INFO:     10.0.0.7:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        "[{s} DP0 TP0] Prefill batch, #new-seq: 1, #new-token: 81{i}, #cached-token: 324{i}, token usage: 0.9{i}, "
        "#running-req: 4{i}, #queue-req: 3{i}, #pending-token: 0, cuda graph: False, input throughput (token/s): 10234.55",
        "[{s} DP1 TP0] Prefill batch, #new-seq: 2, #new-token: 91{i}, #cached-token: 224{i}, token usage: 0.8{i}, "
        "#running-req: 5{i}, #queue-req: 2{i}, #pending-token: 0, cuda graph: False, input throughput (token/s): 9234.55",
        '[{s}] INFO:     10.0.0.8:41234 - "POST /generate HTTP/1.1" 200 OK',
        "[{s} DP0 TP0] KV cache pool is full. Retract requests. #retracted_reqs: {i}, #new_tokens_gained: 646, "
        "#new_token_ratio: 0.0980 -> 0.3487",
        "[{s} DP0 TP1] KV cache pool is full. Retract requests. #retracted_reqs: {i}, #new_tokens_gained: 646, "
        "#new_token_ratio: 0.0980 -> 0.3487",
        '[{s}] INFO:     10.0.0.9:31234 - "GET /health HTTP/1.1" 200 OK',
        "(APIServer pid=12) INFO {v} [loggers.py:248] Engine 000: Avg prompt throughput: 1024.5 tokens/s, "
        "Avg generation throughput: 2048.3 tokens/s, Running: 4{i} reqs, Waiting: 3{i} reqs, Preemptions: {i}, "
        "GPU KV cache usage: 97.{i}%, Prefix cache hit rate: 45.{i}%",
        "(APIServer pid=12) INFO {v} [loggers.py:248] Engine 001: Avg prompt throughput: 1024.5 tokens/s, "
        "Avg generation throughput: 2048.3 tokens/s, Running: 3{i} reqs, Waiting: 0 reqs, "
        "GPU KV cache usage: 67.{i}%, Prefix cache hit rate: 55.{i}%",
        '(APIServer pid=12) INFO {v} [launcher.py:99] 10.0.0.7:51234 - "POST /v1/completions HTTP/1.1" 200 OK',
    )
)
LINES_PER_SECOND = SECOND.count("\n")


def generate(path: Path, size_mb: float, json_file: bool = False) -> int:
    """Write about ``size_mb`` MiB of log (before any wrapping), a few MiB at a time, plain or as
    docker json-file records; returns the line count."""
    limit = int(size_mb * 2**20)
    t = datetime(2026, 11, 29, 11, 0, tzinfo=timezone.utc)
    written = lines = 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < limit:
            chunk = []
            for _ in range(1000):
                chunk.append(SECOND.format(s=t.strftime("%Y-%m-%d %H:%M:%S"), v=t.strftime("%m-%d %H:%M:%S"),
                                           i=t.second % 10))
                t += timedelta(seconds=1)
            text = "".join(chunk)
            fh.write(_json_file(text, t) if json_file else text)
            written += len(text)
            lines += 1000 * LINES_PER_SECOND
    return lines


def _json_file(text: str, t: datetime) -> str:
    stamp = t.strftime("%Y-%m-%dT%H:%M:%S.123456789Z")
    return "".join(json.dumps({"log": line, "stream": "stderr", "time": stamp}, separators=(",", ":")) + "\n"
                   for line in text.splitlines(keepends=True))


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def parse(path: Path, total: int) -> tuple[float, int, dict[str, float], LogReport]:
    """Stream ``path`` through read_log: seconds, samples, peak RSS at 10/50/100 % of the lines, report."""
    marks = {int(total * f): f for f in (0.1, 0.5)}
    rss_at: dict[str, float] = {}
    stream = read_log(path, year=2026)
    samples = 0
    started = time.perf_counter()
    for _ in stream:
        samples += 1
        if marks and stream.report.lines >= min(marks):
            rss_at[f"{marks.pop(min(marks)):.0%}"] = round(max_rss_mib(), 1)
    seconds = time.perf_counter() - started
    rss_at["100%"] = round(max_rss_mib(), 1)
    return seconds, samples, rss_at, stream.report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=1024, help="log size in MiB (default 1024)")
    ap.add_argument("--dir", default=None, help="where to write the temporary log (default: the system temp dir)")
    ap.add_argument("--no-json-file", action="store_true", help="skip the docker json-file run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvdiag-bench-logs-") as tmp:
        path = Path(tmp) / "server.log"
        started = time.perf_counter()
        total = generate(path, args.size_mb)
        gen_s = time.perf_counter() - started
        size = path.stat().st_size
        rss_before = max_rss_mib()
        seconds, samples, rss_at, report = parse(path, total)
        path.unlink()
        wrapped: dict[str, object] = {}
        if not args.no_json_file:
            jpath = Path(tmp) / "container-json.log"
            generate(jpath, args.size_mb, json_file=True)
            jsize = jpath.stat().st_size
            jseconds, jsamples, jrss, jreport = parse(jpath, total)
            assert jsamples == samples and jreport.unparsed == report.unparsed, "json-file must read the same"
            wrapped = {"lines_per_second": round(jreport.lines / jseconds), "max_rss_mib": jrss["100%"],
                       "size_mib": round(jsize / 2**20, 1), "vs_plain": round(seconds / jseconds, 2)}
    print(f"generated {size / 2**20:.0f} MiB, {total:,} lines in {gen_s:.1f}s; parsed in {seconds:.1f}s: "
          f"{report.lines / seconds:,.0f} lines/s, {size / 2**20 / seconds:.1f} MiB/s, {samples:,} samples, "
          f"{report.unparsed} unparsed, {report.duplicate_rank_lines:,} duplicate-rank lines")
    print(f"peak RSS (MiB): before parsing {rss_before:.1f}, at " + ", ".join(f"{k} {v}" for k, v in rss_at.items()))
    if wrapped:
        print(f"docker json-file ({wrapped['size_mib']} MiB): {wrapped['lines_per_second']:,} lines/s, "
              f"{wrapped['vs_plain']}x the plain log's rate, peak RSS {wrapped['max_rss_mib']} MiB")
    print(json.dumps({
        "lines_per_second": round(report.lines / seconds),
        "max_rss_mib": rss_at["100%"],
        "mib_per_second": round(size / 2**20 / seconds, 1),
        "size_mib": round(size / 2**20, 1),
        "lines": report.lines,
        "samples": samples,
        "parse_seconds": round(seconds, 1),
        "rss_mib_before_parse": round(rss_before, 1),
        "rss_mib_at": rss_at,
        "json_file": wrapped or None,
    }))


if __name__ == "__main__":
    main()
