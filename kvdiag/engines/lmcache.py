"""LMCache's own exporter (``lmcache:*``): the KV tier below a vLLM instance's GPU pool.

LMCache 0.5.6 (``lmcache/observability.py``) labels its series ``model_name, worker_id, role,
served_model_name``; the worker processes write them to a multiprocess directory, so they reach
either the vLLM server's own /metrics (a shared ``PROMETHEUS_MULTIPROC_DIR``) or LMCache's own
/metrics (its internal API server), a second target. Either way they join the vLLM instance by
its served model name. LMCache exports its bytes in use (``local_cache_usage``) but no capacity,
so it is judged on hits, never on occupancy: the tokens it retrieved (``num_hit_tokens``) over
every token vLLM looked up in it (``num_lookup_tokens``: a request's whole prompt,
``LMCacheEngine.lookup``). Its other two counters each measure something else:
``num_lookup_hits`` is the prefix it holds, GPU-resident blocks included (vLLM's connector
retrieves only ``lookup hits - num_computed_tokens``, ``vllm_v1_adapter.get_num_new_matched_tokens``),
so it counts as help what L1 already held; ``num_requested_tokens`` is only what a lookup found
and vLLM then sent to retrieve, so retrieved over requested reads near 1 whatever the tier holds.
That pair is read only where a version counts no lookups, and its provenance says so. Its
workers (one per TP rank) count the same tokens: the max is taken.

A tier is not an engine: an exposition with only these series gives a ``tier_only`` sample per
served model, which ``kvdiag.window.windows`` folds into the engine instance of the same model.
"""

from __future__ import annotations

from kvdiag.engines.base import Instance, instance_key, put, value
from kvdiag.exposition import Exposition
from kvdiag.model import PoolSample

NAME = "lmcache"
P = "lmcache:"
TIER = "LMCache"
HITS = P + "num_hit_tokens"
#: What the retrieved tokens are a share of: every token looked up, else (a version that counts
#: no lookups) the tokens sent to retrieve, with what the share then means.
QUERIES = (
    (P + "num_lookup_tokens", "LMCache: tokens it retrieved (its lookups' hits beyond vLLM's own GPU prefix hits) "
                              "of every token vLLM looked up in it"),
    (P + "num_requested_tokens", "LMCache retrieves: this LMCache counts no lookups, and retrieve requests only ask "
                                 "for what a lookup found, so this share reads near 1 whatever the tier holds"),
)
SIGNATURE = (HITS,) + tuple(name for name, _ in QUERIES)
WANTED = SIGNATURE + (P + "local_cache_usage",)
#: The labels that name the model, the served name first (it is what vLLM's model_name holds).
MODEL_LABELS = ("served_model_name", "model_name")


def detect(expo: Exposition) -> bool:
    return any(expo.get(name) is not None for name in SIGNATURE)


def models(expo: Exposition) -> list[str]:
    """The served models LMCache reports for (its served name, else its model name)."""
    fam = expo.get(HITS)
    seen: dict[str, None] = {}
    for s in fam.samples if fam is not None else ():
        name = next((s.labels[k] for k in MODEL_LABELS if s.labels.get(k)), None)
        if name is not None:
            seen.setdefault(name)
    return list(seen)


def instances(expo: Exposition, target: str) -> list[Instance]:
    return [Instance(instance_key(target, {"model": m}), {}, m) for m in models(expo)]


def read(expo: Exposition, ps: PoolSample) -> bool:
    """LMCache's retrieved tokens for ``ps.model`` and what they are a share of (``QUERIES``)
    into the L2 fields; whether there were any."""
    hits = expo.get(HITS)
    if hits is None or ps.model is None:
        return False
    for label in MODEL_LABELS:
        select = {label: ps.model}
        if value(hits, {}, "_total", select) is None:
            continue
        name, note = next(((n, why) for n, why in QUERIES if value(expo.get(n), {}, "_total", select) is not None),
                          (None, "LMCache retrieved tokens; it counts no lookups or retrieve requests"))
        if put(ps, "l2_hit_tokens_total", HITS, hits, {}, suffix="_total", select=select, note=note) is not None:
            put(ps, "l2_query_tokens_total", name, expo.get(name) if name else None, {}, suffix="_total", select=select, note=note)
            ps.l2_tier = TIER
            return True
    return False


def normalize(expo: Exposition, target: str, ts: float) -> list[PoolSample]:
    """One tier-only sample per served model, to join its engine instance."""
    out = []
    for inst in instances(expo, target):
        ps = PoolSample(inst.key, NAME, ts, model=inst.model, tier_only=True)
        ps.notes.append(
            f"{TIER}'s own exporter: a KV tier with no GPU pool of its own, judged with the vLLM instance serving "
            f"{inst.model} on the same host (or the only one); add that vLLM server as a target")
        if read(expo, ps):
            ps.check_parts()
            out.append(ps)
    return out
