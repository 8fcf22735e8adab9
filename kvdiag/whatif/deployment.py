"""A deployment as a replay sees it: KV dtype, the pool its engine reported, a scale model.

The catalogue's ``Deployment`` sizes its pool from the capacity model alone. A replay of an
incident must start from the pool the engine reported, and a remedy changes it by what the
capacity model says the change buys (``Sized``). A scale model (``scale`` = k > 1) divides the
pool by k (the arrivals are divided alike, ``whatif.scale``) while each step takes as long as
the full-size step would (``ScaledRoofline``), so queueing and TTFT keep their magnitudes at a
k-th of the simulation's cost.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvdiag import capacity
from kvdiag.capacity import DTYPE_BYTES
from kvdiag.refpool.roofline import Roofline, StepCost, Work, work
from kvdiag.refpool.types import StepPlan
from kvdiag.refpool.scenarios import Deployment


#: Steps over which a scale model's prefill beside decodes is averaged (``ScaledRoofline``).
PREFILL_SMOOTHING_STEPS = 64


class ScaledRoofline(Roofline):
    """The roofline of a full-size batch for a batch of a scale model: ``scale`` times the
    tokens, context and pairs (a k-th of the load makes a k-th of each step's work).

    Prefill that shares a step with decodes (vLLM's mixed batches) is timed at its running
    average over the last ``PREFILL_SMOOTHING_STEPS`` decoding steps, not as it comes. The model
    admits a k-th of the prompts, so its steps carry a whole prompt or none, each timed as k of
    them, where the full-size engine spreads k times as many prompts over its steps; a step costs
    the larger of compute and memory time, and a decode step's spare compute hides a full-size
    step's share of prefill that a whole prompt times k does not fit in. Timed as it comes, the
    model ran a fifth more congested than full size. Prefill-only steps (SGLang's) are timed as
    they come. Stateful: one instance per engine loop."""

    def __init__(self, scale: float, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.scale = scale
        self._prefill = (0.0, 0.0, 0.0)  # averaged tokens, context, pairs of prefill beside decodes

    def batch_cost(self, tokens: int, context: int, pairs: float) -> StepCost:
        k = self.scale
        return super().batch_cost(round(tokens * k), round(context * k), pairs * k)

    def cost(self, plan: StepPlan) -> StepCost:
        (tokens, context, pairs), prefill = work(plan)
        if not tokens:  # no decode to hide prefill behind: as it comes
            return self.batch_cost(*prefill)
        return self._decoding(tokens, context, pairs, prefill)

    def batch_seconds(self, tokens: int, context: int, pairs: float) -> float:
        """A fast-forwarded decode step: no prefill of its own, the average beside it. (The
        engine loop may time a step it then takes one by one; the average then decays by one
        more prefill-free step, which only engines that mix prefill into decode runs would feel:
        neither reference engine offers such runs.)"""
        return self._decoding(tokens, context, pairs, (0, 0, 0.0)).seconds

    def _decoding(self, tokens: int, context: int, pairs: float, prefill: Work) -> StepCost:
        a = 1.0 / PREFILL_SMOOTHING_STEPS
        self._prefill = avg = tuple(m + a * (x - m) for m, x in zip(self._prefill, prefill))  # type: ignore[assignment]
        return self.batch_cost(tokens + round(avg[0]), context + round(avg[1]), pairs + avg[2])


@dataclass(frozen=True)
class Sized(Deployment):
    """A deployment with its KV dtype, and the pool its engine reported under ``reported_as``.

    ``pool_tokens`` is ``reported_pool`` scaled by the capacity model's pool here over its pool
    under ``reported_as`` (exactly ``reported_pool`` when nothing changed), so a fit whose
    model, GPU or memory fraction were assumed still starts from the engine's own pool."""

    kv_dtype: str = "bf16"
    reported_pool: int | None = None
    reported_as: Deployment | None = None
    # ``scale`` (Deployment's): a scale model's k, the pool divided by it, step times as at full size

    @property
    def model_pool(self) -> int:
        """Pool tokens per GPU by the capacity model alone (``kvdiag capacity``)."""
        spec = capacity.model(self.model)
        gpu = capacity.GPUS[self.gpu]
        pool_bytes, _ = capacity.pool_from_memory(spec, self.tp, gpu.memory_bytes, self.mem_fraction, spec.weight_bytes(2))
        return pool_bytes // spec.kv_bytes_per_token_per_gpu(DTYPE_BYTES[self.kv_dtype], self.tp)

    @property
    def pool_tokens(self) -> int:
        pool = self.model_pool
        if self.reported_pool is not None and self.reported_as is not None:
            pool = round(self.reported_pool * pool / sized(self.reported_as).model_pool)
        return round(pool / self.scale)

    def roofline(self) -> Roofline:
        if self.scale != 1.0:
            return ScaledRoofline(self.scale, self.model, self.gpu, tp=self.tp, kv_dtype=self.kv_dtype)
        return Roofline(self.model, self.gpu, tp=self.tp, kv_dtype=self.kv_dtype)


def sized(d: Deployment) -> Sized:
    """``d`` as a ``Sized`` (bf16 KV, its model pool) when it is a plain ``Deployment``."""
    return d if isinstance(d, Sized) else Sized(**{f.name: getattr(d, f.name) for f in fields(Deployment)})
