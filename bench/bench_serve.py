"""Exporter throughput and memory: targets per core at a 5 s interval, RSS with full windows.

Usage: .venv/bin/python bench/bench_serve.py [--targets N] [--window S] [--intervals K] [--full]

What it runs: N loopback targets, served by a child process (so its CPU is not counted) that
answers each with a real engine fixture from ../shared/fixtures (SGLang 0.5.23, 101 KB, and
vLLM 0.33.0, 65 KB, alternating), and this process running the real exporter loop
(``ScrapeLoop``: one deadline-bound HTTP connection per scrape, the targeted reader, the engine adapters, the
ring buffers, the checks every ``evaluate_every``) plus a Prometheus-style render of /metrics
every 15 s.

The hour is compressed, not waited for: after every target's first scrape its ring is filled
with a full window of samples (``--window``, default 1 h = 720 samples at 5 s) before the
clock starts, so both the memory (rings are preallocated and full) and the checks' cost
(materializing and evaluating a full window) are those of an exporter that has been running
for the whole window. Then K real intervals are measured: process CPU time (user + sys) per
scrape, wall time, scrapes done versus due, RSS before and after (flat = no growth).

``targets_per_core`` = interval / CPU seconds per target per interval: how many targets one
fully busy core keeps up with. Defaults are small (200 targets, 3 intervals) for a shared
machine; ``--full`` runs 2,000 targets for 12 intervals. The last line is the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import ctypes
import ctypes.util
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
BODIES = ("sglang-0.5.23-midload.prom", "vllm-0.33.0-midload.prom")


# --- the child: N engine endpoints on one loopback port -------------------------------------


def serve(fixtures: Path) -> None:
    """Answer GET /t/<i>/metrics with fixture i % 2, keep-alive, until stdin closes."""
    bodies = []
    for name in BODIES:
        body = (fixtures / name).read_bytes()
        head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(body)}\r\n\r\n"
        bodies.append(head.encode() + body)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                index = int(path.split(b"/")[2]) if path.startswith(b"/t/") else 0
                writer.write(bodies[index % 2])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, IndexError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent goes

    asyncio.run(main())


# --- the parent: the exporter under measurement --------------------------------------------


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def fill_windows(loop, interval: float) -> None:  # type: ignore[no-untyped-def]
    """The compressed hour: each instance's ring filled with a full window behind its newest
    sample (copies of it, one interval apart), as after running for the whole window; and its
    last evaluation placed at an even phase of ``evaluate_every``, as in the steady state, so
    any measured span pays its share of full-window evaluations."""
    states = loop.snapshot()
    for n, state in enumerate(states):
        with state.lock:
            for inst in state.instances.values():
                latest = inst.latest
                ring = type(inst.ring)(inst.ring.capacity)
                for k in range(ring.capacity - 1, 0, -1):
                    old = copy.copy(latest)
                    old.ts = latest.ts - k * interval
                    ring.append(old)
                ring.append(latest)
                inst.ring = ring
                inst.evaluated_at = latest.ts - loop.opts.evaluate_every * n / len(states)


def release_fill_garbage() -> None:
    """Hand back to the OS the memory the fill itself churned through (1.4 M throwaway sample
    copies at 2,000 targets): glibc keeps freed heap pages, which would count a bench artifact
    as the exporter's RSS. The measured span then shows the exporter's own high-water mark."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        ctypes.CDLL(libc).malloc_trim(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=3600.0, help="the checks' window, what each ring holds (s)")
    ap.add_argument("--intervals", type=int, default=3, help="intervals measured after the windows are full")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--evaluate-every", type=float, default=15.0)
    ap.add_argument("--full", action="store_true", help="2,000 targets for 12 intervals")
    ap.add_argument("--fixtures", default=str(FIXTURES))
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(Path(args.fixtures))
        return
    if args.full:
        args.targets, args.intervals = 2000, 12

    from prometheus_client import CollectorRegistry, generate_latest

    from kvdiag.config import Config
    from kvdiag.server.collector import ExporterCollector
    from kvdiag.server.loop import ScrapeLoop
    from kvdiag.server.settings import ScrapeSettings, Settings
    from kvdiag.server.targets import Target

    child = subprocess.Popen([sys.executable, __file__, "--serve", "--fixtures", args.fixtures], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())  # type: ignore[union-attr]
        base_rss = rss_mib()
        settings = Settings(
            targets=tuple(Target(f"http://127.0.0.1:{port}/t/{i}/metrics") for i in range(args.targets)),
            scrape=ScrapeSettings(interval=args.interval, concurrency=args.concurrency, evaluate_every=args.evaluate_every),
            checks=Config(window=args.window),
        )
        loop = ScrapeLoop(settings).start()
        deadline = time.monotonic() + 3 * args.interval + 30
        while not loop.ready and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # let the last first scrapes finish
        fill_windows(loop, args.interval)
        release_fill_garbage()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ExporterCollector(loop.snapshot, settings.checks))

        def appended() -> int:
            return sum(i.ring.appended for s in loop.snapshot() for i in s.instances.values())

        rss_start, scrapes_start, cpu_start, wall_start = rss_mib(), appended(), cpu_seconds(), time.monotonic()
        renders, render_s, metrics_bytes, rss_max, rss_series = 0, 0.0, 0, rss_start, []
        end = wall_start + args.intervals * args.interval
        next_render = wall_start
        while time.monotonic() < end:
            if time.monotonic() >= next_render:  # Prometheus scraping the exporter every 15 s
                t = time.perf_counter()
                metrics_bytes = len(generate_latest(registry))
                render_s += time.perf_counter() - t
                renders += 1
                rss_series.append(round(rss_mib()))
                next_render += 15.0
            rss_max = max(rss_max, rss_mib())
            time.sleep(0.1)
        wall = time.monotonic() - wall_start
        cpu = cpu_seconds() - cpu_start
        scrapes = appended() - scrapes_start
        rss_end = rss_mib()
        states = loop.snapshot()
        evaluate_every = loop.opts.evaluate_every
        ring_bytes = sum(i.ring.nbytes for s in states for i in s.instances.values())
        loop.stop()
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=10)
    due = args.targets * wall / args.interval
    per_scrape = cpu / scrapes if scrapes else float("nan")
    capacity = states[0].instances and next(iter(states[0].instances.values())).ring.capacity
    figures = {
        "command": "bench/bench_serve.py " + " ".join(sys.argv[1:]),
        "targets": args.targets,
        "interval_s": args.interval,
        "window_s": args.window,
        "ring_rows_per_instance": capacity,
        "evaluate_every_s": evaluate_every,
        "measured_wall_s": round(wall, 2),
        "scrapes": scrapes,
        "scrapes_due": round(due),
        "kept_up": round(scrapes / due, 3) if due else None,
        "targets_down": sum(1 for s in states if not s.up),
        "cpu_s": round(cpu, 3),
        "cpu_cores_busy": round(cpu / wall, 3),
        "cpu_ms_per_scrape": round(per_scrape * 1e3, 3),
        "targets_per_core": round(args.interval / per_scrape) if scrapes else None,
        "metrics_render_ms": round(render_s / renders * 1e3, 1) if renders else None,
        "metrics_bytes": metrics_bytes,
        "rss_mib_before_loop": round(base_rss, 1),
        "rss_mib_windows_full": round(rss_start, 1),
        "rss_mib_end": round(rss_end, 1),
        "rss_growth_mib": round(rss_end - rss_start, 1),
        "rss_mib_max_measured": round(rss_max, 1),
        "rss_mib_every_15s": rss_series,
        "peak_rss_mib_incl_setup": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_kib_per_target": round((rss_end - base_rss) * 1024 / args.targets, 1),
        "ring_kib_per_target": round(ring_bytes / 1024 / args.targets, 1),
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
