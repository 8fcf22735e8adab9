"""kvdiag's rules at fleet scale: a real Prometheus (the Debian package) scraping a synthetic fleet.

The fleet (``tests/mixin/fleet.py``) is made of the project's real engine expositions (a vLLM
0.33.0 and an SGLang 0.5.23 server at mid load), half of each. Every instance replays a
saturation story (load ramps from 0.2 to 1.4 of the pool and back over 40 minutes: usage pins,
the queue grows, requests are preempted / retracted, first tokens slow past the SLO) at its own
phase offset (20 offsets per engine, so any fleet of a multiple of 40 instances holds the same
mix); counters keep the fixture's values as their start and only grow, across loops too. One
loopback HTTP server serves every instance by path (``/t/<i>/metrics``); Prometheus finds them
through file_sd, one target group per instance, and relabelling sets ``instance``.

``--families read`` (the default) serves only the families the rules read and applies the
generated keep-list (``rules/keep``); ``--families all`` serves the whole expositions.

Reported per rule group: average and maximum evaluation time against the interval (every
evaluation seen after the warm-up, read from /api/v1/rules every few seconds), missed
iterations and failures after the warm-up; at the end, the CPU seconds Prometheus spends on
one evaluation of each group (its expressions run through the query API, timed by Prometheus'
own CPU counter: what the group costs whatever else runs on the machine); head series and RSS; the share of
instances each kvdiag alert is active on (pending or firing), sampled every minute after the
warm-up; ``KvdiagEngineMetricsAbsent`` instances (every instance sends its families, so any is
wrong); the load average; and with ``--dashboards`` every dashboard panel query with every
instance selected (Grafana's "All"), timed 3 times each, p50 and max.

Usage: .venv/bin/python bench/bench_rules.py --instances 1000 --minutes 10 [--interval 15s]
       [--families read|all] [--dashboards] [--json out.json]
Needs `prometheus` on PATH (scripts/system-deps.sh). Last line: JSON with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvdiag.config import parse_duration, prom_duration  # noqa: E402
from kvdiag.render import KEEP_LIST, RULES_ALERTS, RULES_RECORDING, render_all  # noqa: E402
from tests.mixin.fleet import Fleet  # noqa: E402

def serve(port_out: "multiprocessing.Queue[int]", keep_regex: str | None) -> None:
    """The fleet's HTTP server (a child process): HTTP/1.1 keep-alive, GET /t/<i>/metrics."""
    fleet = Fleet(re.compile(keep_regex) if keep_regex else None)

    class Conn(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while b"\r\n\r\n" in self.buf:
                head, self.buf = self.buf.split(b"\r\n\r\n", 1)
                path = head.split(b" ", 2)[1].decode()
                m = re.fullmatch(r"/t/(\d+)/metrics", path)
                if m is None:
                    self.t.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")  # type: ignore[attr-defined]
                    continue
                body = fleet.body(int(m.group(1)))
                self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: "  # type: ignore[attr-defined]
                             + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", 0, backlog=4096)
        port_out.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def prometheus_config(workdir: Path, port: int, n: int, interval: str, keep: list[dict] | None, rules: bool = True) -> Path:
    targets = [{"targets": [f"127.0.0.1:{port}"], "labels": {"__metrics_path__": f"/t/{i}/metrics",
                                                              "__fleet_instance": f"engine-{i}:8000"}} for i in range(n)]
    (workdir / "fleet.json").write_text(json.dumps(targets))
    for name in (RULES_RECORDING, RULES_ALERTS):
        (workdir / Path(name).name).write_text(RENDERED[name])
    job = {
        "job_name": "fleet",
        "scrape_timeout": prom_duration(min(10.0, 0.8 * parse_duration(interval))),
        "file_sd_configs": [{"files": [str(workdir / "fleet.json")]}],
        "relabel_configs": [{"source_labels": ["__fleet_instance"], "target_label": "instance"}],
    }
    if keep:
        job["metric_relabel_configs"] = keep
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(workdir / Path(name).name) for name in (RULES_RECORDING, RULES_ALERTS)] if rules else [],
        "scrape_configs": [job],
    }
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


RENDERED: dict[str, str] = {}


def metrics(url: str) -> dict[str, float]:
    """Prometheus' own /metrics, the families the bench reads, keyed by sample text."""
    out = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("prometheus_rule_group_iterations_missed_total", "prometheus_rule_evaluation_failures_total",
                            "prometheus_rule_group_iterations_total", "prometheus_tsdb_head_series ",
                            "process_resident_memory_bytes", "process_cpu_seconds_total")):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def by_group(m: dict[str, float], family: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, v in m.items():
        if key.startswith(family):
            g = re.search(r'rule_group="[^"]*;([^"]+)"', key)
            if g:
                out[g.group(1)] = out.get(g.group(1), 0.0) + v
    return out


def query(url: str, expr: str, **params: str) -> list[dict]:
    path = "query_range" if "start" in params else "query"
    r = requests.get(f"{url}/api/v1/{path}", params={"query": expr, **params}, timeout=120).json()
    if r.get("status") != "success":
        raise RuntimeError(f"{expr}: {r}")
    return r["data"]["result"]


def cpu_per_evaluation(url: str, rule_files: list[str], reps: int = 3, budget_s: float = 240.0) -> dict[str, float]:
    """Prometheus' CPU seconds for one evaluation of each group: its rules' expressions run
    through the query API in order, ``reps`` times, timed by the process's own CPU counter. Unlike
    an evaluation's wall time this does not grow with what else runs on the machine, so it
    says what the group costs on cores of its own."""
    out = {}
    stop = time.monotonic() + budget_s  # bounded: fewer runs (at least one) where time runs out
    for text in rule_files:
        for g in yaml.safe_load(text)["groups"]:
            before, done = metrics(url)["process_cpu_seconds_total"], 0
            while done < reps and (done == 0 or time.monotonic() < stop):
                for r in g["rules"]:
                    query(url, r["expr"])
                done += 1
            out[g["name"]] = (metrics(url)["process_cpu_seconds_total"] - before) / done
    return out


def dashboard_timings(url: str, interval: float, span: float, budget_s: float = 300.0) -> list[tuple[str, float]]:
    """Every panel query of the committed dashboards, every instance selected, 3 runs each
    (fewer where ``budget_s`` runs out first: the bench stays bounded on a slow machine)."""
    out: list[tuple[str, float]] = []
    end = time.time()
    stop = time.monotonic() + budget_s
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        d = json.loads(path.read_text())
        for p in d["panels"]:
            for t in p["targets"]:
                expr = re.sub(r"\$(job|instance|model)\b", ".*", t["expr"])
                for _ in range(3):
                    if time.monotonic() > stop:
                        return out
                    start = time.perf_counter()
                    if t.get("instant"):
                        query(url, expr)
                    else:
                        query(url, expr, start=str(end - span), end=str(end), step=str(interval))
                    out.append((f"{d['title']} / {p['title']}", time.perf_counter() - start))
    return out


def scraping(url: str, n: int, interval_s: float, seconds: float) -> dict:
    """What the scrapes alone did over the last ``seconds``: each target's mean scrape duration
    (p50 and max over targets), the scrapes made against the scrapes due (every target every
    interval), and the targets up at the end."""
    span = prom_duration(max(interval_s, seconds))
    durations = [float(s["value"][1]) for s in query(url, f"avg_over_time(scrape_duration_seconds[{span}])")]
    made = query(url, f"sum(count_over_time(up[{span}]))")
    up = query(url, "sum(up)")
    due = n * seconds / interval_s
    errors: dict[str, int] = {}
    for t in requests.get(url + "/api/v1/targets", params={"state": "active"}, timeout=120).json()["data"]["activeTargets"]:
        if t.get("lastError"):
            # the error without the target's own address, so alike errors add up
            key = re.sub(r"http://\S+", "URL", t["lastError"])[:80]
            errors[key] = errors.get(key, 0) + 1
    return {"scrape_errors": errors, "scrape_s_p50": statistics.median(durations) if durations else math.nan,
            "scrape_s_max": max(durations, default=math.nan),
            "scrapes_made_pct": 100 * float(made[0]["value"][1]) / due if made and due else math.nan,
            "targets_up": float(up[0]["value"][1]) if up else 0.0}


def run(n: int, minutes: float, interval_s: float, families: str, warmup_min: float, dashboards: bool,
        binary: str, rules: bool = True) -> dict:
    interval = prom_duration(interval_s)
    RENDERED.update(render_all(interval=interval_s))
    keep = yaml.safe_load(RENDERED[KEEP_LIST])["metric_relabel_configs"] if families == "read" else None
    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    server = multiprocessing.Process(target=serve, args=(ports, keep[0]["regex"] if keep else None), daemon=True)
    server.start()
    port = ports.get(timeout=60)
    work = Path(tempfile.mkdtemp(prefix="bench-rules-"))
    config = prometheus_config(work, port, n, interval, keep, rules)
    log = (work / "prometheus.log").open("w")
    prom_port = 19090 + os.getpid() % 1000
    url = f"http://127.0.0.1:{prom_port}"
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=2h"],
                            stdout=log, stderr=subprocess.STDOUT)
    evals: dict[str, dict[str, float]] = {}
    rule_evals: dict[str, dict[str, float]] = {}
    intervals: dict[str, float] = {}
    shares: dict[str, list[float]] = {}
    absent_max, loads = 0, []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(url + "/-/ready", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("Prometheus did not start:\n" + (work / "prometheus.log").read_text()[-3000:])
            time.sleep(1)
        t0 = time.monotonic()
        warm_end, end = t0 + warmup_min * 60, t0 + minutes * 60
        base: dict[str, float] | None = None
        next_share = warm_end
        while time.monotonic() < end:
            now = time.monotonic()
            if base is None and now >= warm_end:
                base = metrics(url)
            try:
                groups = requests.get(url + "/api/v1/rules", timeout=60).json()["data"]["groups"]
            except (requests.RequestException, ValueError):
                groups = []
            for g in groups:
                intervals[g["name"]] = g["interval"]
                if now >= warm_end and g.get("lastEvaluation", "").startswith("20"):
                    evals.setdefault(g["name"], {})[g["lastEvaluation"]] = g["evaluationTime"]
                    for r in g["rules"]:
                        rule_evals.setdefault(f"{g['name']} {r['name']}", {})[r.get("lastEvaluation", "")] = r["evaluationTime"]
            if now >= next_share:
                next_share += 60
                loads.append(os.getloadavg()[0])
                if not rules:
                    print(f"  t={int(now - t0)}s load={loads[-1]:.2f}", file=sys.stderr)
                    time.sleep(min(3.0, interval_s / 4))
                    continue
                counted = query(url, "count(instance:kvdiag_instance:info)")
                total = float(counted[0]["value"][1]) if counted else 0.0
                active = {s["metric"]["alertname"]: float(s["value"][1])
                          for s in query(url, 'count by (alertname) (ALERTS{alertname=~"Kvdiag.*"})')}
                for name in ("KvdiagL1KVPoolBottleneck", "KvdiagL1KVPoolPressure", "KvdiagKVPoolNearCapacity",
                             "KvdiagQueueWithoutKVPressure", "KvdiagEngineMetricsAbsent", "KvdiagCacheHealthyButTTFTBad"):
                    shares.setdefault(name, []).append(100 * active.get(name, 0.0) / n)
                absent_max = max(absent_max, int(active.get("KvdiagEngineMetricsAbsent", 0)))
                print(f"  t={int(now - t0)}s instances={total:.0f} active={active} load={loads[-1]:.2f}", file=sys.stderr)
            time.sleep(min(3.0, interval_s / 4))
        last = metrics(url)
        base = base or last
        measured = time.monotonic() - (warm_end if base is not last else t0)
        missed = {g: v - by_group(base, "prometheus_rule_group_iterations_missed_total").get(g, 0.0)
                  for g, v in by_group(last, "prometheus_rule_group_iterations_missed_total").items()}
        failures = {g: v - by_group(base, "prometheus_rule_evaluation_failures_total").get(g, 0.0)
                    for g, v in by_group(last, "prometheus_rule_evaluation_failures_total").items()}
        out = {
            "instances": n, "families": families, "rules": rules, "scraping": scraping(url, n, interval_s, measured), "interval_s": interval_s, "minutes": minutes, "warmup_min": warmup_min,
            "groups": {g: {"interval_s": intervals.get(g), "evaluations": len(v), "avg_s": statistics.mean(v.values()),
                           "max_s": max(v.values()), "avg_pct": 100 * statistics.mean(v.values()) / intervals[g],
                           "max_pct": 100 * max(v.values()) / intervals[g], "missed": missed.get(g, 0.0),
                           "missed_since_start": by_group(last, "prometheus_rule_group_iterations_missed_total").get(g, 0.0),
                           "failures": failures.get(g, 0.0)} for g, v in evals.items() if v},
            "head_series": last.get("prometheus_tsdb_head_series", math.nan),
            "rss_gib": last.get("process_resident_memory_bytes", math.nan) / 2**30,
            # Prometheus' CPU after the warm-up, in cores: what it costs whatever else runs beside it
            "prometheus_cores": (last.get("process_cpu_seconds_total", 0.0) - base.get("process_cpu_seconds_total", 0.0)) / measured,
            "slowest_rules": sorted(((statistics.mean(v.values()), k) for k, v in rule_evals.items() if v), reverse=True)[:12],
            "alert_share_pct": {k: statistics.mean(v) for k, v in shares.items()},
            "alert_share_pct_last": {k: v[-1] for k, v in shares.items()},
            "metrics_absent_max": absent_max,
            "load_avg_1m": {"mean": statistics.mean(loads) if loads else math.nan, "max": max(loads, default=math.nan)},
            "cpus": os.cpu_count(),
        }
        if rules:
            out["cpu_s_per_evaluation"] = cpu_per_evaluation(url, [RENDERED[RULES_RECORDING], RENDERED[RULES_ALERTS]])
        if dashboards and rules:
            timings = dashboard_timings(url, interval_s, min(3600.0, minutes * 60))
            values = [t for _, t in timings]
            worst = max(timings, key=lambda x: x[1])
            out["dashboards"] = {"timed": len(values), "p50_s": statistics.median(values), "max_s": max(values),
                                 "slowest": worst[0]}
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        server.terminate()
        server.join(10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=1000, help="fleet size (a multiple of 40 keeps the mix exact)")
    ap.add_argument("--minutes", type=float, default=10.0, help="run length, warm-up included")
    ap.add_argument("--warmup", type=float, default=5.0, help="minutes before evaluations, misses and shares count")
    ap.add_argument("--interval", default="15s", help="scrape and rule evaluation interval")
    ap.add_argument("--families", choices=("read", "all"), default="read")
    ap.add_argument("--dashboards", action="store_true", help="time every dashboard query at the end")
    ap.add_argument("--no-rules", action="store_true", help="load no rules: the baseline of scraping and ingestion alone")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    binary = shutil.which("prometheus")
    if binary is None:
        sys.exit("prometheus is not installed (scripts/system-deps.sh installs the Debian package)")
    out = run(args.instances, args.minutes, parse_duration(args.interval), args.families, args.warmup, args.dashboards, binary,
              rules=not args.no_rules)
    for g, f in out["groups"].items():
        print(f"{g:18s} every {f['interval_s']:g}s: avg {f['avg_s']:.3f}s ({f['avg_pct']:.1f}%), max {f['max_s']:.3f}s "
              f"({f['max_pct']:.1f}%), {f['evaluations']} evaluations, missed {f['missed']:g} "
              f"({f['missed_since_start']:g} since the start), failures {f['failures']:g}")
    print(f"head series {out['head_series']:.0f}, RSS {out['rss_gib']:.2f} GiB, Prometheus CPU {out['prometheus_cores']:.2f} cores, "
          f"load average {out['load_avg_1m']}")
    print("scraping:", {k: v if isinstance(v, dict) else round(v, 3) for k, v in out["scraping"].items()})
    if "cpu_s_per_evaluation" in out:
        print("Prometheus CPU per evaluation (s):", {g: round(v, 3) for g, v in out["cpu_s_per_evaluation"].items()})
    print("slowest rules (avg s):", [(round(t, 3), name) for t, name in out["slowest_rules"]])
    print("alert active share %:", {k: round(v, 1) for k, v in out["alert_share_pct"].items()})
    if "dashboards" in out:
        print("dashboards:", out["dashboards"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
