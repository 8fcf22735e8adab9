"""A small fleet through a real Prometheus: the layered rules give each instance the verdict the
Python checks give it, on the real engine expositions the fleet is made of.

Forty instances of ``fleet.Fleet`` (the bench's fleet, steady: each instance holds its phase's
load while its counters keep counting; vLLM 0.33.0 and SGLang 0.5.23 expositions from
``../shared/fixtures``, only the families the rules read) on loopback, one scrape job each,
scraped every second by a Prometheus running the rules rendered for a 1 s interval with the
keep-list. Every body served is kept for the Python checks. The test waits (bounded) until
Prometheus' verdicts and findings (its ALERTS, pending or firing) equal the Python diagnosis
of the same scrapes for every instance, and requires the fleet to hold more than one verdict.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvdiag.checks import diagnose
from kvdiag.checks.catalog import FINDINGS
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Scrape
from kvdiag.refpool.serve import MetricsServer
from kvdiag.render import KEEP_LIST, RULES_ALERTS, RULES_RECORDING, render_all
from kvdiag.window import windows
from tests.mixin.conftest import need
from tests.mixin.fleet import PHASES, Fleet
from tests.mixin.prom import Prometheus
from tests.mixin.test_prometheus import _verdicts_from_alerts

CONFIG = Config()
INSTANCES = 2 * PHASES  # every phase of both engines once
CTYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Member:
    """One instance on loopback, the scrapes it answered, and their samples read so far."""

    server: MetricsServer
    scrapes: list[Scrape] = field(default_factory=list)
    samples: list[PoolSample] = field(default_factory=list)
    read: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def python(self) -> dict[tuple[str, str], tuple[str, set[str]]]:
        """(engine, dp_rank) -> (verdict, alerting findings) of the scrapes served so far."""
        with self.lock:
            new, self.read = self.scrapes[self.read:], len(self.scrapes)
        self.samples += [s for sc in new for s in normalize_scrape(sc)]
        out = {}
        for window in windows(self.samples, CONFIG.window).values():
            d = diagnose(window, CONFIG)
            labels = window.last.labels
            out[(labels.get("engine", ""), labels.get("dp_rank", ""))] = (
                d.verdict.name, {f.name for f in d.findings if FINDINGS[f.name].alert})
        return out


def test_a_fleet_gets_the_python_verdicts_from_the_rules(tmp_path: Path) -> None:
    binary = need("prometheus")
    rendered = render_all(interval=1.0)
    keep = yaml.safe_load(rendered[KEEP_LIST])["metric_relabel_configs"]
    fleet = Fleet(re.compile(keep[0]["regex"]), steady=True, seconds_per_step=1.0)
    members: dict[str, Member] = {}
    for i in range(INSTANCES):

        def answer(openmetrics: bool, i: int = i) -> tuple[str, str]:
            body = fleet.body(i).decode()
            m = members[f"fleet-{i}"]
            with m.lock:
                m.scrapes.append(Scrape(time.time(), m.server.url, CTYPE, body))
            return body, CTYPE

        members[f"fleet-{i}"] = Member(MetricsServer(answer))
    for path in (RULES_RECORDING, RULES_ALERTS):
        (tmp_path / Path(path).name).write_text(rendered[path])
    prom = Prometheus(binary, tmp_path, [tmp_path / Path(p).name for p in (RULES_RECORDING, RULES_ALERTS)],
                      {name: m.server.url for name, m in members.items()}, keep)
    for m in members.values():
        m.server.start()
    try:
        prom.start()

        def python() -> dict[tuple[str, str, str], tuple[str, set[str]]]:
            return {(name, *key): v for name, m in members.items() for key, v in m.python().items()}

        def agree() -> bool:
            got = _verdicts_from_alerts(prom)
            return len(got) == INSTANCES and got == python()

        try:
            prom.wait(agree, 240, "every fleet instance's verdict in ALERTS to equal Python's", every=3)
        except AssertionError as exc:
            got, want = _verdicts_from_alerts(prom), python()
            diff = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
            raise AssertionError(f"{exc}; (prometheus, python) where they differ: {diff}\n{prom.logs()}") from None
        verdicts = {v for v, _ in python().values()}
        assert len(verdicts) > 1, verdicts  # the fleet's phases tell different stories
    finally:
        prom.stop()
        for m in members.values():
            m.server.stop()
