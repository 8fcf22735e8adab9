"""The rules on a stalled Prometheus: overrun iterations never make a rule fail, and a value the
TSDB refuses is a second one for a timestamp its series already holds: nothing is lost.

Why the log says "Error on ingesting results from rule evaluation with different value but same
timestamp" (seen for ``kvdiag-usage``'s admission need on the real-vLLM stack, and for a dozen
``kvdiag-instance`` rules at once in a CI run): Prometheus 2.42's group loop takes, at each tick,
``missed = time.Since(last) / interval - 1`` and evaluates ``last + (missed + 1) * interval``. Its
ticker runs at the phase of the group's first wake-up, which on a busy machine comes late after
the group's slot. When an iteration overruns its interval and ends between a slot and that
late tick, it takes the slot as its timestamp, the next tick comes less than an interval after
it, ``missed`` is -1, and the group evaluates the same timestamp again. A rule whose inputs moved
in between (another group's output, a scrape that landed) computes a slightly different value,
and the TSDB keeps the first. It is not two series with one label set: Prometheus refuses such a
result whole ("vector contains metrics with the same labelset after applying rule labels") and
counts it in ``prometheus_rule_evaluation_failures_total``; the plain aggregations in the CI
run's list cannot even produce one.

The test makes the machine's stalls on purpose: it stops Prometheus (SIGSTOP) across the groups'
first slots, so every group's ticker runs behind its slots, then stops it again for longer than
an interval, over and over, so iterations overrun. With Prometheus logging at debug level, every
refused value names its series and timestamp. It requires: iterations were missed (the stalls
overran the groups); no rule failed, every rule healthy; and each refused value's series holds a
sample at that very timestamp in the TSDB, or else reads absent there (a stale marker).

Why a stale marker: a stall outlasts the scrape timeout, the scrape fails, and Prometheus marks
the target's series stale at that scrape's timestamp. An evaluation at a timestamp after it finds
an instant input absent (``instance:kvdiag_instance:info`` in a join), so its result is absent and
the rule's series gets a stale marker at that timestamp (and the rules reading that series in
turn); the repeated evaluation, after the next scrape landed, computes a value there and is
refused. Absent is what the rule should say while
its target's last scrape failed: a failed CI run's ``instance:kvdiag_prefix_hit:ratio5m``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import yaml

from kvdiag.render import KEEP_LIST, RULES_ALERTS, RULES_RECORDING, render_all
from kvdiag.render.rules import groups as rule_groups
from kvdiag.refpool.serve import MetricsServer
from tests.conftest import hang_guard
from tests.mixin.conftest import need
from tests.mixin.fleet import Fleet
from tests.mixin.prom import Prometheus

INSTANCES = 8  # both engines, four phases each
CTYPE = "text/plain; version=0.0.4; charset=utf-8"
STALL_S, RUN_S, CYCLES = 2.2, 1.5, 10  # each stall longer than two 1 s intervals
DISCARDED = re.compile(r'msg="Rule evaluation result discarded" err="([^"]*)" sample="((?:[^"\\]|\\.)*)"')
SAMPLE = re.compile(r"^\{(.*)\} => (\S+) @\[(\d+)\]$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def refused(log: str) -> list[tuple[str, dict[str, str], int]]:
    """(error, labels, timestamp in ms) of every rule result the TSDB refused (debug log)."""
    out = []
    for err, sample in DISCARDED.findall(log):
        m = SAMPLE.match(sample.replace('\\"', '"'))
        assert m, sample
        out.append((err, dict(LABEL.findall(m.group(1))), int(m.group(3))))
    return out


def _stall(prom: Prometheus, seconds: float) -> None:
    assert prom.proc is not None
    os.kill(prom.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(prom.proc.pid, signal.SIGCONT)


def test_a_stalled_prometheus_loses_no_rule_result(tmp_path: Path) -> None:
    binary = need("prometheus")
    rendered = render_all(interval=1.0)
    keep = yaml.safe_load(rendered[KEEP_LIST])["metric_relabel_configs"]
    fleet = Fleet(re.compile(keep[0]["regex"]), steady=True, seconds_per_step=1.0)
    servers = {f"fleet-{i}": MetricsServer(lambda openmetrics, i=i: (fleet.body(i).decode(), CTYPE)) for i in range(INSTANCES)}
    for path in (RULES_RECORDING, RULES_ALERTS):
        (tmp_path / Path(path).name).write_text(rendered[path])
    prom = Prometheus(binary, tmp_path, [tmp_path / Path(p).name for p in (RULES_RECORDING, RULES_ALERTS)],
                      {name: s.url for name, s in servers.items()}, keep, flags=("--log.level=debug",))
    for s in servers.values():
        s.start()
    try:
        prom.start()
        # the groups start on their next slot (within an interval) once the rule manager runs:
        # a stall across it wakes each group, and starts its ticker, late after its slot
        prom.wait(lambda: "Starting rule manager" in prom.logs(tail=None), hang_guard(10), "the rule manager to start", every=0.005)
        _stall(prom, 1.3)
        for _ in range(CYCLES):
            time.sleep(RUN_S)
            _stall(prom, STALL_S)
        time.sleep(3)  # the last overrun iterations finish

        ours = set(rule_groups())
        missed = {k: v for k, v in prom.own_metrics("prometheus_rule_group_iterations_missed_total").items()
                  if k.split(";")[-1].rstrip('"}') in ours}
        assert sum(missed.values()) > 0, missed  # the stalls overran the groups
        failures = prom.own_metrics("prometheus_rule_evaluation_failures_total")
        assert failures and not any(failures.values()), failures
        for g in prom.api("rules")["groups"]:
            for r in g["rules"]:
                assert r["health"] == "ok" and not r.get("lastError"), (g["name"], r["name"], r.get("lastError"))

        for err, labels, ts in refused(prom.logs(tail=None)):
            assert err == "duplicate sample for timestamp", err
            selector = "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            at = f"{ts / 1000:.3f}"
            held = prom.query(f"{selector}[5s]", time=at)
            if held and any(round(float(t) * 1000) == ts for t, _ in held[0]["values"]):
                continue
            # else the first evaluation at ts found its inputs stale and wrote a stale marker: the
            # series reads absent at ts (a gap would read its previous sample). Staleness starts at
            # a scrape that failed across a stall and travels down the chain of recording rules,
            # so the failed scrape can be well before ts (a CI run: none in the 5 s before)
            assert not prom.query(selector, time=at), (selector, ts, held)
    finally:
        if prom.proc is not None and prom.proc.poll() is None:
            os.kill(prom.proc.pid, signal.SIGCONT)
        prom.stop()
        for s in servers.values():
            s.stop()
