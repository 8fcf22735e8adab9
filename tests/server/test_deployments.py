"""The exporter on the deployments beyond one unified pool, end to end: the reference engines
serve a PD decode instance (SGLang, its prefill instance beside it), a vLLM decode instance whose
requests wait for their KV transfer, a hybrid sliding-window model and vLLM with LMCache's own
exporter as a target of its own, each on a loopback port (``kvdiag.refpool.serve``). The real
scrape loop scrapes them all; /metrics and the JSON API must give the CLI's verdict on the same
expositions, with the role, the binding pool, the queues by kind and the tier, and LMCache's
series must reach the vLLM instance's verdict through the exporter's join.

Each story is simulated once, an exposition every ``STEP`` simulated seconds, and each server
serves the step after the last one its story's engine instance has taken (a story clock driven
by the exporter's ingestion, not the wall clock): the exporter reads every step once, in order,
whatever the machine's speed. The checks' spans are the defaults divided by the speed (as the
demo's exporter runs them: ``wall_config``). The same expositions go through the committed
recording rules (promtool), whose queue and pool series the dashboards' panels read. What this
adds to CI: the four stories cut to where their verdict holds (~5 s of simulation), ~12 scrape
rounds at ``INTERVAL`` (~4 s) and one promtool run (~1 s).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvdiag import cli
from kvdiag.commands.demo import wall_config
from kvdiag.config import Config
from kvdiag.model import Scrape
from kvdiag.refpool.emit import content_type
from kvdiag.refpool.scenarios import ScenarioRun, get
from kvdiag.refpool.serve import MetricsServer
from kvdiag.refpool.sim import EPOCH
from kvdiag.render import RULES_RECORDING
from kvdiag.server.app import create_app
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.probe import Allowlist
from kvdiag.server.settings import ProbeSettings, ScrapeSettings, Settings
from kvdiag.server.state import TargetState
from kvdiag.server.targets import Target
from kvdiag.sources.recording import write_recording
from tests.mixin.conftest import ROOT, need
from tests.mixin.test_differential import input_series
from tests.server.conftest import SCRAPE_DEADLINE_S, settings_for, wait_for

STEP = 15.0  # simulated seconds between two expositions (the CLI tests' scrape interval)
INTERVAL = 0.3  # wall seconds between two scrapes of a target
MAIN = "engine"  # the story's engine instance; its side targets are named as ScenarioRun names them
#: story -> (scenario, engine, where the story is cut: a verdict that holds a step either side).
STORIES = {
    "pd-decode": ("pd-decode-pool", "sglang", 165.0),
    "deferred-decode": ("pd-kv-transfer", "vllm", 75.0),
    "hybrid-swa": ("hybrid-swa", "sglang", 75.0),
    "lmcache": ("lmcache-underused", "vllm", 90.0),
}
#: One host serves every story and LMCache joins the vLLM instance of its model on its host, so
#: the LMCache story serves a model of its own (the deferred-decode story serves the same Llama).
LMCACHE_MODEL = "llama-3-70b-lmcache"


def record(story: str) -> list[dict[str, str]]:
    """The story's expositions, one per step: the engine's and its side targets' (``prefill``,
    ``lmcache``), rendered at the same simulated instant."""
    name, engine, end = STORIES[story]
    scenario = get(name)
    if story == "lmcache":
        scenario = replace(scenario, deployment=replace(scenario.deployment, served_model=LMCACHE_MODEL))
    run = ScenarioRun(scenario, engine)
    steps = []
    for k in range(1, int(end // STEP) + 1):
        run.advance(k * STEP)
        steps.append({MAIN: run.exposition(), **run.side_targets()})
    return steps


@dataclass
class Story:
    """One story's servers: each serves the step after the last one the exporter took from the
    story's engine instance (so a failed scrape is served again, never skipped)."""

    steps: list[dict[str, str]]
    servers: dict[str, MetricsServer] = field(default_factory=dict)
    state: TargetState | None = None  # the exporter's state of the engine target, once it exists

    def taken(self) -> int:
        """Steps the exporter has ingested from the engine instance."""
        return max((i.ring.appended for i in list(self.state.instances.values())), default=0) if self.state else 0

    def serve(self) -> "Story":
        for role in self.steps[0]:
            def body(_wants_om: bool, role: str = role) -> tuple[str, str]:
                return self.steps[min(self.taken(), len(self.steps) - 1)][role], content_type(False)

            self.servers[role] = MetricsServer(body).start()
        return self

    def url(self, role: str = MAIN) -> str:
        return self.servers[role].url

    def done(self) -> bool:
        """The exporter took the last step and evaluated the window ending there."""
        insts = list(self.state.instances.values()) if self.state else []
        return bool(insts) and all(i.ring.appended >= len(self.steps) and i.latest is not None and i.evaluated_at == i.latest.ts for i in insts)


@dataclass
class Answers:
    """What the exporter said once every story was told: /metrics, and the JSON API."""

    stories: dict[str, Story]
    metrics: dict[str, list]  # family -> samples
    verdicts: dict[str, dict]  # instance -> the /api/v1/verdicts entry
    rows: dict[str, dict]  # instance -> the /api/v1/instances row
    cli: dict[str, dict]  # instance -> ``kvdiag diagnose --json --replay`` of the same expositions

    def series(self, family: str, instance: str, **match: str) -> dict[tuple[str, ...], float]:
        """The family's samples of one instance, keyed by the values of the labels named in
        ``match`` (an empty value: any)."""
        out = {}
        for s in self.metrics.get(family, []):
            if s.labels.get("instance") == instance and all(not v or s.labels.get(k) == v for k, v in match.items()):
                out[tuple(s.labels.get(k, "") for k in match)] = s.value
        return out


def _instance(stories: dict[str, Story], story: str, role: str = MAIN) -> str:
    """The instance key the adapters give the story's target (vLLM names its engine)."""
    url = stories[story].url(role)
    return url + (" engine=0" if STORIES[story][1] == "vllm" and role != "lmcache" else "")


def _cli(stories: dict[str, Story], tmp: Path) -> dict[str, dict]:
    """``kvdiag diagnose --json --replay`` of every story's expositions, in simulated time, under
    the URLs the exporter scraped (so the instances are named alike)."""
    scrapes = [
        Scrape(EPOCH + (k + 1) * STEP + 0.1 * j, story.url(role), content_type(False), body)
        for story in stories.values()
        for k, step in enumerate(story.steps)
        for j, (role, body) in enumerate(step.items())
    ]
    path = tmp / "stories.jsonl.gz"
    write_recording(path, sorted(scrapes, key=lambda s: s.ts))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli.main(["diagnose", "--json", "--replay", str(path)])
    return {d["instance"]: d for d in json.loads(buf.getvalue())["instances"]}


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Answers]:
    stories = {name: Story(record(name)).serve() for name in STORIES}
    urls = [s.url(role) for s in stories.values() for role in s.servers]
    settings = Settings(
        targets=tuple(Target(u) for u in urls),
        scrape=ScrapeSettings(interval=INTERVAL, timeout=SCRAPE_DEADLINE_S, concurrency=len(urls), evaluate_every=0.0),
        checks=wall_config(Config(), STEP / INTERVAL),
    )
    loop = ScrapeLoop(settings)
    for story in stories.values():
        story.state = loop.targets[story.url()]
    try:
        loop.start()
        finished = wait_for(lambda: all(s.done() for s in stories.values()))
        loop.stop()  # the stories are told: nothing after their last step is read
        assert finished, {n: (s.taken(), len(s.steps)) for n, s in stories.items()}
        assert wait_for(lambda: not any(t.busy for t in loop.snapshot()))  # scrapes in flight end
        assert all(t.up for t in loop.snapshot()), {t.url: t.error for t in loop.snapshot()}
        client = TestClient(create_app(loop), base_url="http://127.0.0.1:10877")
        metrics = {f.name: f.samples for f in text_string_to_metric_families(client.get("/metrics").text)}
        verdicts = {d["instance"]: d for d in client.get("/api/v1/verdicts").json()["instances"]}
        rows = {r["instance"]: r for r in client.get("/api/v1/instances").json()["instances"]}
        yield Answers(stories, metrics, verdicts, rows, _cli(stories, tmp_path_factory.mktemp("stories")))
    finally:
        loop.stop()
        for story in stories.values():
            for server in story.servers.values():
                server.stop()


def _verdict(a: Answers, instance: str) -> str:
    """The one verdict /metrics gives the instance, checked against the API's and the CLI's."""
    (hot,) = [v for (v,), on in a.series("kvdiag_verdict", instance, verdict="").items() if on == 1]
    assert hot == a.verdicts[instance]["verdict"] == a.cli[instance]["verdict"], (hot, a.verdicts[instance]["verdict"], a.cli[instance]["verdict"])
    return hot


def _info(a: Answers, instance: str) -> tuple[str, str]:
    """(role, l2_tier) of ``kvdiag_instance_info``."""
    (key,) = a.series("kvdiag_instance_info", instance, role="", l2_tier="")
    return key  # type: ignore[return-value]


def test_pd_decode_instance_is_l1_bound_and_waits_in_its_prealloc_queue(answers: Answers) -> None:
    a, inst = answers, _instance(answers.stories, "pd-decode")
    assert _verdict(a, inst) == "l1_kv_bottleneck"
    assert _info(a, inst) == ("decode", "") and a.verdicts[inst]["role"] == "decode"
    queues = a.series("kvdiag_queue_requests", inst, queue="", kind="")
    prealloc = queues[("decode prealloc queue", "capacity")]
    assert prealloc >= 50 and queues[("waiting queue", "capacity")] < prealloc / 10
    assert a.series("kvdiag_waiting_requests", inst)[()] == sum(v for (_, kind), v in queues.items() if kind != "in_flight")
    assert "wants decode capacity" in a.verdicts[inst]["reason"]
    assert "decode prealloc queue (waiting for room in this pool)" in a.verdicts[inst]["checks"]["queue_growing"]["evidence"]["summary"]
    prefill = _instance(a.stories, "pd-decode", "prefill")
    assert _verdict(a, prefill) == "queue_without_kv_pressure" and _info(a, prefill) == ("prefill", "")
    assert a.series("kvdiag_queue_requests", prefill, queue="prefill bootstrap queue", kind="deferred")[("prefill bootstrap queue", "deferred")] > 0


def test_deferred_decode_waits_for_its_kv_transfer_not_for_room(answers: Answers) -> None:
    a, inst = answers, _instance(answers.stories, "deferred-decode")
    assert _verdict(a, inst) == "queue_without_kv_pressure"
    assert _info(a, inst) == ("decode", "")
    by_kind: dict[str, float] = {}
    for (_, kind), v in a.series("kvdiag_queue_requests", inst, queue="", kind="").items():
        by_kind[kind] = by_kind.get(kind, 0.0) + v
    assert by_kind["capacity"] == 0 and by_kind["deferred"] > 0 and by_kind["in_flight"] > 0
    assert "deferred (waiting for their KV transfer)" in a.verdicts[inst]["reason"]


def test_hybrid_model_names_the_binding_pool(answers: Answers) -> None:
    a, inst = answers, _instance(answers.stories, "hybrid-swa")
    assert _verdict(a, inst) == "l1_kv_pressure"
    assert a.series("kvdiag_kv_binding_pool", inst, pool="") == {("full",): 0, ("swa",): 1}
    usage = a.series("kvdiag_kv_pool_usage_ratio", inst, pool="")
    assert usage[("swa",)] > usage[("full",)] and usage[("swa",)] >= 0.9
    evidence = a.verdicts[inst]["checks"]["kv_usage_saturated"]["evidence"]
    assert evidence["binding_pool"] == "swa" and evidence["swa_pool_usage"] == usage[("swa",)]


def test_lmcache_on_its_own_target_reaches_the_vllm_instance_verdict(answers: Answers) -> None:
    """LMCache's /metrics is scraped as a target of its own; its hits join the vLLM instance of
    its model on its host, which gets the tier on /metrics and in its evidence, while the tier's
    own target shows its health and no verdict of its own."""
    a, inst = answers, _instance(answers.stories, "lmcache")
    tier_url = a.stories["lmcache"].url("lmcache")
    assert _verdict(a, inst) == "l1_kv_bottleneck"
    assert _info(a, inst) == ("", "LMCache")
    l2 = a.verdicts[inst]["checks"]["l2_underused"]["evidence"]
    assert (l2["l2_tier"], l2["judged_on"], l2["l2_hit_share_of"]) == ("LMCache", "hits", "the tier's own lookups")
    assert f"joined by model from {tier_url}" in l2["sources"]["l2_hit_tokens_total"]
    assert a.series("kvdiag_l2_hit_ratio", inst)[()] == pytest.approx(l2["l2_hit_share"]) == pytest.approx(a.cli[inst]["checks"]["l2_underused"]["evidence"]["l2_hit_share"], rel=0.1)
    (tier,) = [i for i in a.rows if i.startswith(tier_url)]
    assert a.series("kvdiag_up", tier) == {(): 1}
    assert a.series("kvdiag_verdict", tier, verdict="") == {} and tier not in a.verdicts and tier not in a.cli
    assert (a.rows[tier]["verdict"], a.rows[tier]["joined_to"]) == (None, inst)
    # the other vLLM instances on the host serve another model: nothing joined them
    assert _info(a, _instance(a.stories, "deferred-decode", "prefill"))[1] == ""


def test_the_rules_record_the_queues_and_pools_the_exporter_shows(answers: Answers, tmp_path: Path) -> None:
    """The dashboards' queue-by-reason and pools-by-kind panels read the rules' series; on the
    same expositions (promtool, at each story's last step) they hold the queues and the hybrid
    model's pools, named and tagged alike, that the exporter's /metrics gives. (For a one-pool
    model the rules keep the pool gauges SGLang exports, its full pool and 0 for the others,
    where the exporter lists no pools: only the hybrid story compares pools.)"""
    promtool = need("promtool")
    tests = []
    for story, role in (("pd-decode", MAIN), ("pd-decode", "prefill"), ("deferred-decode", MAIN), ("hybrid-swa", MAIN)):
        steps = answers.stories[story].steps
        inst = _instance(answers.stories, story, role)
        expected = []
        compared = [("instance:kvdiag_queue:requests", "kvdiag_queue_requests", ("queue", "kind"))]
        if story == "hybrid-swa":
            compared.append(("instance:kvdiag_kv_pool_usage:ratio", "kvdiag_kv_pool_usage_ratio", ("pool",)))
        for rule, family, labels in compared:
            shown = {k: v for k, v in answers.series(family, inst, **dict.fromkeys(labels, "")).items() if v != 0}
            expected.append({
                "expr": f"sum by ({', '.join(labels)}) ({rule} != 0)",
                "eval_time": f"{int((len(steps) - 1) * STEP)}s",
                "exp_samples": [{"labels": "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, key)) + "}", "value": v} for key, v in shown.items()],
            })
        tests.append({"name": f"{story} {role}", "interval": f"{int(STEP)}s", "promql_expr_test": expected,
                      "input_series": input_series(SimpleNamespace(bodies=tuple(s[role] for s in steps)),  # type: ignore[arg-type]
                                                   {"job": "kvdiag", "instance": "engine:8000"})})
    shown = [s for t in tests for e in t["promql_expr_test"] for s in e["exp_samples"]]
    assert len(shown) >= 7 and any('pool="swa"' in s["labels"] for s in shown)  # not vacuous
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [str(ROOT / RULES_RECORDING)], "evaluation_interval": f"{int(STEP)}s",
                                    "tests": tests}, sort_keys=False, width=100_000))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_probed_lmcache_joins_the_probed_vllm_instance(answers: Answers, start_loop: Callable[[Settings], ScrapeLoop]) -> None:
    """The multi-target pattern: Prometheus probes LMCache's exporter and the vLLM server apart.
    Probed alone, the tier is ``unknown`` (it has no pool); once the vLLM server is probed, its
    instance carries the tier and the tier's own probe shows only its health."""
    story = answers.stories["lmcache"]
    loop = start_loop(replace(settings_for([]), probe=ProbeSettings(Allowlist.build(cidrs=["127.0.0.0/8"]))))
    client = TestClient(create_app(loop), base_url="http://127.0.0.1:10877")

    def probe(url: str) -> dict[str, list]:
        resp = client.get("/probe", params={"target": url})
        assert resp.status_code == 200, resp.text
        return {f.name: f.samples for f in text_string_to_metric_families(resp.text)}

    alone = probe(story.url("lmcache"))
    assert [s.labels["verdict"] for s in alone["kvdiag_verdict"] if s.value == 1] == ["unknown"]
    engine = probe(story.url())
    assert [s.labels["l2_tier"] for s in engine["kvdiag_instance_info"]] == ["LMCache"]
    joined = probe(story.url("lmcache"))
    assert [s.value for s in joined["kvdiag_up"]] == [1] and not joined.get("kvdiag_verdict")
