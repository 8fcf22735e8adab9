"""``kvdiag simulate``: run a labelled scenario on a reference engine; serve or record its metrics.

``--port`` serves the engine's /metrics on loopback while simulated time runs at wall time ×
``--speed`` (the scheduler advances under the simulation's lock, so a scrape never sees a half
step). ``--out`` writes a recording instead, one scrape per ``--interval`` of simulated time
stamped in simulated epoch seconds, as fast as the simulator runs: ``kvdiag diagnose --replay``
and ``kvdiag inspect --replay`` read it like any recording.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from rich.console import Console

from kvdiag.refpool import emit
from kvdiag.refpool.scenarios import CATALOGUE, ENGINES, ScenarioRun, get
from kvdiag.refpool.serve import MetricsServer
from kvdiag.refpool.sim import tune_gc
from kvdiag.sources.recording import RecordingWriter

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("simulate")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--engine", choices=ENGINES, help="which reference engine")
    p.add_argument("--scenario", choices=sorted(CATALOGUE), help="which scenario (see --list)")
    p.add_argument("--port", type=int, help="serve /metrics on 127.0.0.1:PORT (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default loopback)")
    p.add_argument("--speed", type=float, default=10.0, help="simulated seconds per wall second when serving (default 10)")
    p.add_argument("--out", metavar="REC.jsonl.gz", help="write a recording instead of serving, as fast as possible")
    p.add_argument("--interval", type=float, default=5.0, help="simulated seconds between recorded scrapes (default 5)")
    p.add_argument("--duration", type=float, help="simulated seconds to run (default: the scenario's)")
    p.add_argument("--dialect", help="engine release whose exposition to write (default: the newest)")
    p.add_argument("--mem-fraction", type=float, help="re-size the pool: the deployment's static memory fraction (default 0.9)")
    p.add_argument("--lmcache-shared", action="store_true",
                   help="with an LMCache tier: LMCache's series in vLLM's /metrics (one shared multiprocess directory)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.list:
        _list(Console())
        return 0
    problem = _check(args)
    if problem:
        print(f"kvdiag simulate: {problem}", file=sys.stderr)
        return EXIT_ERROR
    scenario = get(args.scenario, args.mem_fraction)
    tune_gc()
    try:
        sim = ScenarioRun(scenario, args.engine)
        sim.exposition(args.dialect, shared_lmcache=args.lmcache_shared)  # a dialect that cannot render this server fails here, once
    except ValueError as exc:
        print(f"kvdiag simulate: {exc}", file=sys.stderr)
        return EXIT_ERROR
    duration = args.duration if args.duration is not None else scenario.duration
    if args.out:
        return _record(sim, args.out, args.interval, duration, args.dialect)
    return _serve(sim, args, duration)


def _check(args: argparse.Namespace) -> str | None:
    if not args.engine or not args.scenario:
        return "give --engine and --scenario (or --list)"
    if (args.port is None) == (args.out is None):
        return "give exactly one of --port (serve) or --out (record)"
    dialects = emit.SGLANG_DIALECTS if args.engine == "sglang" else emit.VLLM_DIALECTS
    if args.dialect and args.dialect not in dialects:
        return f"unknown {args.engine} dialect {args.dialect!r}; known: {', '.join(dialects)}"
    if args.speed <= 0 or args.interval <= 0 or (args.duration is not None and args.duration <= 0):
        return "--speed, --interval and --duration must be > 0"
    return None


def _list(console: Console) -> None:
    """Name, size and intended verdict of each scenario, then its story (the expected verdict
    itself is derived from the run's ground truth by ``kvdiag validate``)."""
    for s in CATALOGUE.values():
        intents = {e: ", ".join(s.intent_for(e)) for e in s.engines}
        intent = next(iter(intents.values())) if len(set(intents.values())) == 1 else "; ".join(f"{e}: {v}" for e, v in intents.items())
        if s.engines != ENGINES:
            intent += f" ({', '.join(s.engines)} only)"
        console.print(f"[bold]{s.name}[/bold]  DP={s.dp}  {s.duration:g}s  intended: {intent}", highlight=False)
        console.print(f"    {s.story}", highlight=False)


def _record(sim: ScenarioRun, path: str, interval: float, duration: float, dialect: str | None) -> int:
    start = time.perf_counter()
    with RecordingWriter(path) as writer:
        for _, scrape in sim.scrapes(interval, dialect, until=duration):
            writer.write(scrape)
        count = writer.count
    wall = time.perf_counter() - start
    print(f"wrote {count} scrape(s) of {duration:g} simulated seconds to {path} in {wall:.1f}s", file=sys.stderr)
    return 0


def _serve(sim: ScenarioRun, args: argparse.Namespace, duration: float) -> int:
    def body(wants_om: bool) -> tuple[str, str]:
        return sim.exposition(args.dialect, openmetrics=wants_om, shared_lmcache=args.lmcache_shared), emit.content_type(wants_om)

    def side(target: str):  # noqa: ANN202 (a MetricsServer render callable)
        return lambda wants_om: (sim.side_targets(wants_om)[target], emit.content_type(wants_om))

    servers: list[MetricsServer] = []
    # The deployment's other targets (a PD pair's prefill instance, LMCache's own exporter) on
    # the next ports (any free ones with --port 0), as users scrape them: separate targets.
    targets = [t for t in sim.side_targets() if not (t == "lmcache" and args.lmcache_shared)]
    try:
        for k, name in enumerate([None, *targets]):
            port = args.port + k if args.port else 0
            servers.append(MetricsServer(body if name is None else side(name), host=args.host, port=port).start())
    except OSError as exc:
        print(f"kvdiag simulate: cannot serve on {args.host}:{port} ({exc.strerror})", file=sys.stderr)
        for s in servers:
            s.stop()
        return EXIT_ERROR
    server = servers[0]
    print(f"serving {sim.engine} scenario {sim.scenario.name} on {server.url}/metrics "
          f"({args.speed:g}x, {duration:g} simulated seconds)", file=sys.stderr, flush=True)
    for name, extra in zip(targets, servers[1:]):
        print(f"  {name} target on {extra.url}/metrics", file=sys.stderr, flush=True)
    def lagging(behind: float) -> None:
        print(f"kvdiag simulate: the simulator is {behind:.0f}s behind; lower --speed", file=sys.stderr)

    try:
        sim.follow_wall_clock(args.speed, duration, threading.Event(), lagging)
    except KeyboardInterrupt:
        pass
    finally:
        for s in servers:
            s.stop()
    return 0
