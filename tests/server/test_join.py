"""The exporter's join of a KV tier's own exporter (LMCache) into the engine instance it belongs
to, one scrape at a time (``kvdiag.server.state.join``): the tier on the engine's host, never one
elsewhere; marked joined for ``JOIN_SECONDS`` after an engine took it, then alone again. No
network: the samples are normalized from expositions written by prometheus_client."""

from __future__ import annotations

from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Scrape
from kvdiag.server.ring import Ring
from kvdiag.server.state import InstanceState, join
from kvdiag.window import JOIN_SECONDS
from tests import dialects


def _engine(target: str, ts: float) -> PoolSample:
    (s,) = normalize_scrape(Scrape(ts, target, None, dialects.expose(dialects.vllm_core(dialects.vllm_engine(), 0.9, 8, 0, 0))))
    return s


def _tier(target: str, ts: float, hits: float) -> InstanceState:
    lm = {"model_name": dialects.VL_MODEL, "role": "worker", "served_model_name": dialects.VL_MODEL, "worker_id": "0"}
    body = dialects.expose(dialects.lmcache_counters(lm, 10 * hits, 5 * hits, hits))
    (s,) = normalize_scrape(Scrape(ts, target, None, body))
    assert s.tier_only
    inst = InstanceState(s.instance, Ring(4))
    inst.ingest(s)
    return inst


def test_an_engine_scrape_takes_the_tier_on_its_host_and_marks_it_joined() -> None:
    here, there = _tier("http://10.0.0.7:6999", 100.0, 500), _tier("http://10.0.0.8:6999", 100.5, 900)
    engine = _engine("http://10.0.0.7:8000", 101.0)
    join([engine], [there, here])
    assert (engine.l2_tier, engine.l2_hit_tokens_total, engine.l2_query_tokens_total) == ("LMCache", 500, 5_000)
    assert "joined by model from http://10.0.0.7:6999" in engine.provenance["l2_hit_tokens_total"].note
    assert (here.joined_to, here.joined_at) == (engine.instance, 101.0) and there.joined_to is None
    assert here.joined(101.0 + JOIN_SECONDS) and not here.joined(101.0 + JOIN_SECONDS + 1) and not there.joined(101.0)


def test_a_tier_too_old_or_of_another_model_is_not_joined() -> None:
    old = _tier("http://10.0.0.7:6999", 100.0, 500)
    late = _engine("http://10.0.0.7:8000", 100.0 + JOIN_SECONDS + 1)
    join([late], [old])
    assert late.l2_tier is None and late.l2_hit_tokens_total is None and old.joined_to is None
    other = _engine("http://10.0.0.7:8000", 101.0)
    other.model = "another-model"
    join([other], [old])
    assert other.l2_tier is None and old.joined_to is None
