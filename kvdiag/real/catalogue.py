"""The real stories: each a load on a real engine with the pool and caps it needs.

Light on purpose (no numpy, no checks): the CLI reads the names for ``--scenario`` from here;
kvdiag/real/stories.py runs and scores them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.real.engines import EngineSpec
from kvdiag.real.load import ClosedLoop, OpenLoop, Overload, Phase, Requests


@dataclass(frozen=True)
class Story:
    name: str
    about: str
    load: OpenLoop | ClosedLoop | Overload
    shape: Requests
    engines: tuple[str, ...] = ("vllm", "sglang")
    pool_tokens: int = 2048
    max_running: int = 16
    env: tuple[tuple[str, str], ...] = ()

    @property
    def seconds(self) -> float:
        """The longest the story lasts (an ``Overload``'s length follows the engine)."""
        return self.load.seconds

    def spec(self, engine: str) -> EngineSpec:
        return EngineSpec(engine, pool_tokens=self.pool_tokens, max_running=self.max_running, env=self.env)


LONG = Requests(prompt=(300, 500), prefix=0.7, output=(200, 400))
#: The catalogue, in the order ``kvdiag validate --real`` runs it. Pools of 2,048 tokens hold
#: about four requests of LONG's size; the tiny model generates ~250-500 tokens/s on 2 cores.
STORIES = {s.name: s for s in (
    Story("healthy", "a light open loop: nothing waits",
          OpenLoop((Phase(150, 0.15),)), Requests(prompt=(200, 300), output=(40, 120))),
    Story("open-loop-saturation", "one client for 30 s, then an open loop above what the pool serves (from 1.5 requests/s, raised until the engine refuses for KV, "
          "then 1.5x more and at least twice what it serves) for 120 s from the first sustained refusal, then no arrivals until 25 s after the refusals stop: the queue grows, then drains",
          Overload(ClosedLoop(1, 30), 1.5, hold=120, drain=90, settle=25), LONG),
    Story("closed-loop-saturation", "24 clients, each sending when its last answer returns: the queue stands at clients minus running",
          ClosedLoop(24, 180), Requests(prompt=(300, 500), prefix=0.7, output=(100, 250))),
    Story("sglang-conservative-admission", "SGLang's default admission, outputs of hundreds of tokens: the KV budget refuses admission while usage stays low",
          ClosedLoop(24, 180), Requests(prompt=(300, 500), prefix=0.7, output=(300, 600)), engines=("sglang",)),
    Story("sglang-overcommit", "the same load with SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION=64: admission over-commits and retracts",
          ClosedLoop(24, 180), Requests(prompt=(300, 500), prefix=0.7, output=(300, 600)), engines=("sglang",),
          env=(("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "64"),)),
    Story("queue-without-kv-pressure", "a pool eight times larger and two running requests at most: requests queue on the cap, not on KV "
          "(from 1.2 requests/s, raised until the cap holds the queue, for 130 s from there)",
          Overload(ClosedLoop(1, 20), 1.2, hold=130, by="seqs"), Requests(prompt=(200, 300), output=(100, 200)), pool_tokens=16384, max_running=2),
    Story("high-prefix-hit", "95 % of every prompt is one shared prefix, load above capacity (from 1.5 requests/s, raised until the engine "
          "refuses for KV, for 120 s from there): the hit ratio stays high while requests wait",
          Overload(ClosedLoop(1, 30), 1.5, hold=120), Requests(prompt=(600, 800), prefix=0.95, output=(150, 300))),
)}  # fmt: skip
#: What CI runs on each engine (tests/real): the saturation story every engine tells.
CI_STORY = "open-loop-saturation"
