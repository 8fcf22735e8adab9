"""LMCache in the committed rules and in the CLI's window, on the same scrapes.

LMCache 0.5.6 counts every token vLLM looks up in it (``num_lookup_tokens``), the prefix it holds
(``num_lookup_hits``, the GPU's own prefix hits included) and the tokens it retrieves
(``num_hit_tokens``: only what it holds beyond the GPU's hits, all that retrieve is asked for).
A tier that holds 70 % of the looked-up tokens but retrieves 8 % (the GPU held the rest) is
under-used while L1 is pinned, in Python and in the rules alike: neither its lookups' hits nor
its retrieves' ~100 % say so (that pair is read only from an LMCache that counts no lookups,
and the evidence says what it is worth). Its series reach the vLLM instance of their model on the same host
whether they come on vLLM's own /metrics or from a target of their own (another port), and a
tier target on no engine's host joins the one instance of its model, as
``kvdiag.window.join_tier`` joins it.

One promtool run over four groups of 21 scrapes and the Python checks on each (about 10 s).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from kvdiag.checks import diagnose
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import Scrape
from kvdiag.refpool.sim import EPOCH
from kvdiag.window import windows
from tests import dialects
from tests.mixin.test_differential import INTERVAL, input_series
from tests.mixin.rule_tests import run_rule_tests

STEPS = 21  # five minutes at 15 s: the checks' window
LOOKED_UP = 100_000  # tokens vLLM looks up per scrape interval
LM = {"model_name": dialects.VL_MODEL, "role": "worker", "served_model_name": dialects.VL_MODEL, "worker_id": "0"}


def engine(i: int) -> list[dialects.Metric]:
    """vLLM with its pool pinned (0.97-0.98) and preempting: L1 saturated."""
    return dialects.vllm_core(dialects.vllm_engine(), 0.97 + 0.01 * (i % 2), 48, 0, 3 * i)


def tier(held: float, retrieved: float) -> Callable[[int], list[dialects.Metric]]:
    """LMCache holding ``held`` of the looked-up tokens and retrieving ``retrieved`` of them."""
    return lambda i: dialects.lmcache_counters(LM, LOOKED_UP * i, LOOKED_UP * held * i, LOOKED_UP * retrieved * i)


#: group -> (target URL -> the exposition at scrape i), and the share each vLLM instance reads.
GROUPS = {
    "own targets on two hosts": (
        {"http://10.0.0.7:8000": engine, "http://10.0.0.7:9000": tier(0.7, 0.08),
         "http://10.0.0.8:8000": engine, "http://10.0.0.8:9000": tier(0.8, 0.6)},
        {"10.0.0.7:8000": 0.08, "10.0.0.8:8000": 0.6},
    ),
    "shared /metrics": (
        {"http://10.0.0.7:8000": lambda i: engine(i) + tier(0.7, 0.08)(i)},
        {"10.0.0.7:8000": 0.08},
    ),
    "an LMCache that counts no lookups (retrieves only)": (
        {"http://10.0.0.7:8000": engine, "http://10.0.0.7:9000": lambda i: tier(0.7, 0.08)(i)[2:]},
        {"10.0.0.7:8000": 1.0},
    ),
    "the one tier target, on another host name": (
        {"http://10.0.0.7:8000": engine, "http://lmcache-svc:9000": tier(0.7, 0.08)},
        {"10.0.0.7:8000": 0.08},
    ),
}


def _scrapes(targets: dict) -> list[Scrape]:
    return [Scrape(EPOCH + (i + 1) * INTERVAL + k * 0.3, url, None, dialects.expose(body(i)))
            for i in range(STEPS) for k, (url, body) in enumerate(targets.items())]


def _python(targets: dict) -> dict[str, tuple[float, str, str]]:
    """Per vLLM instance (``host:port``): l2_underused's hit share, status and what the share is
    of, as the CLI joins."""
    samples = [s for scrape in _scrapes(targets) for s in normalize_scrape(scrape)]
    out = {}
    for w in windows(samples).values():
        if w.last.tier_only:
            continue
        res = diagnose(w, Config()).checks["l2_underused"]
        out[w.instance.split("//")[1].split(" ")[0]] = (res.evidence.values["l2_hit_share"], res.status, res.evidence.sources["l2_query_tokens_total"])
    return out


@pytest.fixture(scope="module")
def python() -> dict[str, dict[str, tuple[float, str, str]]]:
    return {name: _python(targets) for name, (targets, _) in GROUPS.items()}


def test_python_reads_retrieved_over_looked_up_on_the_instance_of_its_host(python: dict) -> None:
    for name, (_, shares) in GROUPS.items():
        got = python[name]
        assert set(got) == set(shares), name
        for inst, share in shares.items():
            assert got[inst][0] == pytest.approx(share), (name, inst)
            assert got[inst][1] == ("firing" if share < Config().l2_low_hit_share else "ok"), (name, inst)
            retrieves_only = name.startswith("an LMCache that counts no lookups")
            assert ("lmcache:num_requested_tokens" if retrieves_only else "lmcache:num_lookup_tokens") in got[inst][2]
            assert ("reads near 1 whatever the tier holds" in got[inst][2]) == retrieves_only


def _group(name: str, python: dict) -> dict:
    targets, _ = GROUPS[name]
    series = []
    for url, body in targets.items():
        host_port = url.split("//")[1]
        job = "lmcache" if host_port.endswith(":9000") else "vllm"
        bodies = tuple(dialects.expose(body(i)) for i in range(STEPS))
        series += input_series(SimpleNamespace(bodies=bodies), {"job": job, "instance": host_port})  # type: ignore[arg-type]
    end = f"{int((STEPS - 1) * INTERVAL)}s"
    labels = {inst: f'{{engine="0",instance="{inst}",job="vllm",model_name="{dialects.VL_MODEL}"}}' for inst in python}
    return {
        "name": name,
        "interval": f"{int(INTERVAL)}s",
        "input_series": series,
        "promql_expr_test": [
            {"expr": "round(instance:kvdiag_l2_hit:share5m, 0.0001)", "eval_time": end,
             "exp_samples": [{"labels": labels[inst], "value": round(share, 4)} for inst, (share, _, _) in python.items()]},
            {"expr": 'instance:kvdiag_check:status{check="l2_underused"}', "eval_time": end,
             "exp_samples": [{"labels": labels[inst][:-1] + ',check="l2_underused",__name__="instance:kvdiag_check:status"}',
                              "value": int(status == "firing")}
                             for inst, (_, status, _) in python.items()]},
        ],
    }


def test_rules_read_the_same_share_and_join_as_python_does(python: dict, tmp_path: Path) -> None:
    run_rule_tests([_group(name, python[name]) for name in GROUPS], tmp_path, "lmcache", timeout=300)
