"""Engine adapters: detect which engine served an exposition and normalize it to PoolSamples.

This package is the only place that knows engine names. Each adapter module exposes
``NAME``, ``WANTED`` (the families it reads), ``SIGNATURE``, ``KNOBS``, ``ENABLE_HINT``,
``OUTPUT_RESERVE_CLIP``, ``DECODE_RESERVED_TOKENS``,
``detect(expo)`` and ``normalize(expo, target, ts)``.
"""

from __future__ import annotations

from types import ModuleType

from kvdiag.engines import lmcache, sglang, vllm
from kvdiag.engines.base import Knobs
from kvdiag.exposition import Exposition, Reader, scan_prefixes
from kvdiag.model import PoolSample, Scrape

ADAPTERS: dict[str, ModuleType] = {sglang.NAME: sglang, vllm.NAME: vllm}
#: KV tiers with their own exporter (no pool of their own): read where no engine is, their
#: samples join the engine instance of the same model (``kvdiag.window.windows``).
TIERS: dict[str, ModuleType] = {lmcache.NAME: lmcache}

#: One reader for every family any adapter wants, compiled once per process.
READER = Reader(name for adapter in (*ADAPTERS.values(), *TIERS.values()) for name in adapter.WANTED)


class UnknownEngine(ValueError):
    """The exposition is from neither engine (or has no diagnosable metrics); says why."""


class TooManyInstances(ValueError):
    """One exposition claims more instances than the caller keeps; refused before normalizing."""


def known_metrics() -> frozenset[str]:
    """Every engine family name the adapters read (rules and dashboards may only use these)."""
    return frozenset(READER.wanted)


def knobs(engine: str) -> Knobs:
    return ADAPTERS[engine].KNOBS


def output_reserve_clip(engine: str) -> int | None:
    """The most output tokens the engine's admission charges one request (None: no clip)."""
    return ADAPTERS[engine].OUTPUT_RESERVE_CLIP  # type: ignore[no-any-return]


def usage_after_frees(engine: str) -> bool:
    """Whether the usage gauge is read after a step's finished requests free their room (which
    the next admission refills at once), rather than at admission."""
    return bool(ADAPTERS[engine].USAGE_AFTER_FREES)


def prefill_chunk_tokens(engine: str) -> int | None:
    """The most prompt tokens one step prefills by default (None: not needed for this engine)."""
    return ADAPTERS[engine].PREFILL_CHUNK_TOKENS  # type: ignore[no-any-return]


def decode_reserved_tokens(engine: str) -> int | None:
    """Tokens a decode instance's admission keeps out per request beyond the whole prompt (None:
    its decode admission is the classic one, uncached prompt and output reserve)."""
    return ADAPTERS[engine].DECODE_RESERVED_TOKENS  # type: ignore[no-any-return]


def enable_hint(engine: str) -> str:
    return ADAPTERS[engine].ENABLE_HINT


def detect(expo: Exposition, body: str | bytes = "", engine: str = "auto") -> ModuleType:
    """The adapter for this exposition, from its own signature metrics (never from labels).

    ``engine`` may force an adapter ("sglang"/"vllm"); the exposition must still match it. An
    exposition with no engine but a KV tier's own series (LMCache) gets the tier's reader.
    """
    found = [a for a in ADAPTERS.values() if a.detect(expo)]
    tiers = [t for t in TIERS.values() if t.detect(expo)]
    if engine != "auto":
        if engine not in ADAPTERS:
            raise UnknownEngine(f"unknown engine {engine!r}; expected one of {sorted(ADAPTERS)} or auto")
        if ADAPTERS[engine] in found:
            return ADAPTERS[engine]
        if not found and tiers:  # a KV tier's own exporter beside the engine: joined by model
            return tiers[0]
        raise UnknownEngine(f"no {engine} scheduler metrics in this exposition")
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise UnknownEngine("exposition holds both sglang and vllm scheduler metrics; scrape each engine on its own")
    if tiers:
        return tiers[0]
    prefixes = scan_prefixes(body) if body else []
    seen = f"; metric prefixes seen: {', '.join(prefixes)}" if prefixes else "; the body has no samples"
    raise UnknownEngine(
        "unknown engine: none of the SGLang or vLLM scheduler metrics "
        f"({', '.join(sglang.SIGNATURE[:2] + vllm.SIGNATURE[:2])}, ...) are present{seen}. "
        f"A vLLM started with --disable-log-stats serves only http_*/python_*/process_*; {sglang.ENABLE_HINT}."
    )


#: Instances (data-parallel ranks, engines of a multi-engine server) one exposition may hold:
#: each costs a window of memory in the exporter and a row in every view, so a body with
#: thousands of label values is refused, by the exporter and the commands alike, before any
#: instance is normalized.
MAX_INSTANCES = 256


def normalize_scrape(scrape: Scrape, engine: str = "auto", max_instances: int | None = MAX_INSTANCES) -> list[PoolSample]:
    """Exposition text of one scrape to one PoolSample per engine instance.

    ``max_instances`` refuses a body that claims more instances than that before any of them
    is normalized, so a hostile target costs one pass over its samples, not one per instance.
    """
    expo = READER.read(scrape.body, scrape.content_type)
    adapter = detect(expo, scrape.body, engine)
    if max_instances is not None:
        n = len(adapter.instances(expo, scrape.target))
        if n > max_instances:
            raise TooManyInstances(f"{n} instances in one exposition (at most {max_instances} are kept)")
    return adapter.normalize(expo, scrape.target, scrape.ts)
