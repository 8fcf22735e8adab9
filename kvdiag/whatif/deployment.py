"""A deployment as a replay sees it: KV dtype, the pool its engine reported, a scale model.

The catalogue's ``Deployment`` sizes its pool from the capacity model alone, and times its steps
by a GPU preset's roofline; a replay may instead run at a step-time law fitted to the incident
(``step_law``). A replay of an
incident must start from the pool the engine reported, and a remedy changes it by what the
capacity model says the change buys (``Sized``). A scale model (``scale`` = k > 1) divides the
pool by k (the arrivals are divided alike, ``whatif.scale``) while each step takes as long as
the full-size step would (``refpool.roofline.ScaledRoofline``), so queueing and TTFT keep their
magnitudes at a k-th of the simulation's cost.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvdiag import capacity
from kvdiag.capacity import DTYPE_BYTES
from kvdiag.refpool.roofline import LinearStep, Roofline, ScaledRoofline, StepLaw
from kvdiag.refpool.scenarios import Deployment


@dataclass(frozen=True)
class Sized(Deployment):
    """A deployment with its KV dtype, and the pool its engine reported under ``reported_as``.

    ``pool_tokens`` is ``reported_pool`` scaled by the capacity model's pool here over its pool
    under ``reported_as`` (exactly ``reported_pool`` when nothing changed), so a fit whose
    model, GPU or memory fraction were assumed still starts from the engine's own pool."""

    kv_dtype: str = "bf16"
    reported_pool: int | None = None
    reported_as: Deployment | None = None
    #: The step-time law fitted to the engine's own histograms (``whatif.steptime``), which the
    #: replay runs at instead of the GPU preset's roofline; None: the preset.
    step_law: StepLaw | None = None
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
        if self.step_law is not None:
            return LinearStep(self.step_law, self.model, tp=self.tp, kv_dtype=self.kv_dtype, scale=self.scale)
        if self.scale != 1.0:
            return ScaledRoofline(self.scale, self.model, self.gpu, tp=self.tp, kv_dtype=self.kv_dtype)
        return Roofline(self.model, self.gpu, tp=self.tp, kv_dtype=self.kv_dtype)


def sized(d: Deployment) -> Sized:
    """``d`` as a ``Sized`` (bf16 KV, its model pool) when it is a plain ``Deployment``."""
    return d if isinstance(d, Sized) else Sized(**{f.name: getattr(d, f.name) for f in fields(Deployment)})
