"""Step time of one engine iteration from a roofline: FLOPs against bytes moved (facts §4).

The engine loop needs a duration for every ``StepPlan`` so that queueing, TTFT and the rate at
which the pool fills have realistic magnitudes. A step costs the larger of its compute time and
its memory time, plus tensor-parallel all-reduces and a fixed launch/sampling overhead:

    F = Σ_chunks n·f_lin + f_attn·Σ (n·p + n(n+1)/2)     n new tokens over p cached ones
    B = W(N) + Σ p·kv + N·kv                             weights, KV read, KV written
    t = max(F / (η_c·peak), B / (η_m·BW)) + t_allreduce + t_fixed

One formula covers prefill (large n, compute-bound), decode (n = 1, memory-bound while the batch
is below the ridge point) and vLLM's mixed steps (both parts summed under one max). f_lin is
2 × the active parameters (the facts' worked numbers count it so); f_attn is QKᵀ plus AV per
(query, key) pair; W(N) reads a MoE model's routed experts only as far as N tokens touch them.
η_c, η_m, t_fixed and the link bandwidth are calibration assumptions, not engine facts.

``LinearStep`` is the other law a replay can take: a step time fitted to an engine's own
histograms (``whatif.steptime``), for hardware no GPU preset describes.

``ScaledRoofline`` times a scale model's step (whatif's 1/k replays) as the full-size step;
it lives here, beside the class it extends, so that both compile together (mypyc: a class
outside the compiled modules cannot extend a compiled one).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag import capacity
from kvdiag.capacity import DTYPE_BYTES, GPUSpec, ModelSpec
from kvdiag.refpool.types import StepPlan, pickle_by_fields

ACT_BYTES = 2  # bf16 activations on the all-reduce wire


@dataclass(frozen=True)
class Calibration:
    """Efficiency assumptions (facts §4: prefill MFU ≈ 0.5-0.7, memory ≈ 0.7-0.85)."""

    eta_compute: float = 0.6  # achieved fraction of dense peak FLOPs
    eta_memory: float = 0.8  # achieved fraction of HBM bandwidth
    t_fixed: float = 0.002  # kernel launch, sampling, scheduler overhead per step (s)
    link_bytes_per_s: float = 450e9  # NVLink 4 per direction (900 GB/s bidirectional)


#: Datasheet peaks, no overhead: reproduces the facts' worked numbers.
IDEAL = Calibration(eta_compute=1.0, eta_memory=1.0, t_fixed=0.0)


@dataclass(frozen=True)
class StepCost:
    """One step's cost on one GPU of the TP group, and which bound set its time."""

    flops: float
    bytes: float
    t_compute: float
    t_memory: float
    t_comm: float
    seconds: float

    @property
    def compute_bound(self) -> bool:
        return self.t_compute >= self.t_memory


pickle_by_fields(Calibration, StepCost)


class Roofline:
    """Step-time model for one model on one GPU type at a TP degree."""

    def __init__(
        self,
        model: ModelSpec | str,
        gpu: GPUSpec | str = "h100",
        tp: int = 1,
        kv_dtype: str = "bf16",
        weight_dtype: str = "bf16",
        calibration: Calibration = Calibration(),
    ) -> None:
        self.model = capacity.model(model) if isinstance(model, str) else model
        self.gpu = capacity.GPUS[gpu.lower()] if isinstance(gpu, str) else gpu
        self.tp = tp
        self.cal = calibration
        m = self.model
        w_bytes = DTYPE_BYTES[weight_dtype]
        # FP8 GEMMs run at twice the BF16 dense rate on Hopper (1979 vs 989 TFLOPS).
        self.peak_flops = self.gpu.bf16_dense_flops * (2 if w_bytes == 1 else 1)
        self.linear_flops_per_token = 2 * (m.active_params or m.params or m.estimated_params()) / tp
        self.attn_flops_per_pair = _attn_flops_per_pair(m) / tp
        self.kv_bytes_per_token = m.kv_bytes_per_token_per_gpu(DTYPE_BYTES[kv_dtype], tp)
        expert = _routed_expert_params(m)
        self.dense_weight_bytes = (m.weight_bytes(w_bytes) - expert * w_bytes) / tp
        self.expert_weight_bytes = expert * w_bytes / tp
        self.expert_share = m.experts_per_token / m.experts if m.experts else 0.0
        # Two ring all-reduces per layer (after attention, after the MLP) of N·hidden activations.
        self.comm_bytes_per_token = m.layers * 2 * 2 * (tp - 1) / tp * m.hidden * ACT_BYTES if tp > 1 else 0.0

    def step_time(self, plan: StepPlan) -> float:
        """Seconds the step takes (0 for an idle plan)."""
        return self.cost(plan).seconds

    def cost(self, plan: StepPlan) -> StepCost:
        (tokens, context, pairs), (p_tokens, p_context, p_pairs) = work(plan)
        return self.batch_cost(tokens + p_tokens, context + p_context, pairs + p_pairs)

    def batch_seconds(self, tokens: int, context: int, pairs: float) -> float:
        """``batch_cost(...).seconds``: the engine loop's fast-forward step time."""
        return self.batch_cost(tokens, context, pairs).seconds

    def batch_cost(self, tokens: int, context: int, pairs: float) -> StepCost:
        """Cost of ``tokens`` new tokens over ``context`` cached ones with ``pairs`` causal
        (query, key) pairs in all: the aggregates ``cost`` takes from a plan."""
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        flops = tokens * self.linear_flops_per_token + pairs * self.attn_flops_per_pair
        weights = self.dense_weight_bytes
        if self.expert_weight_bytes:
            # Uniform routing: an expert stays unread only if none of the N tokens picks it.
            weights += self.expert_weight_bytes * (1 - (1 - self.expert_share) ** tokens)
        nbytes = weights + (context + tokens) * self.kv_bytes_per_token
        t_compute = flops / (self.cal.eta_compute * self.peak_flops)
        t_memory = nbytes / (self.cal.eta_memory * self.gpu.hbm_bytes_per_s)
        t_comm = tokens * self.comm_bytes_per_token / self.cal.link_bytes_per_s
        seconds = max(t_compute, t_memory) + t_comm + self.cal.t_fixed
        return StepCost(flops, nbytes, t_compute, t_memory, t_comm, seconds)


Work = tuple[int, int, float]  # (new tokens, cached context tokens, causal (query, key) pairs)


def work(plan: StepPlan) -> tuple[Work, Work]:
    """A plan's decode and prefill work, apart: the aggregated one-token decodes and decode
    chunks (n = 1 over p cached tokens is p + 1 pairs each), then the prefill chunks. Every
    term is a whole number, so the sums are exact in any order."""
    tokens, context = plan.decode_batch, plan.decode_context
    pairs = float(context + tokens)
    p_tokens = p_context = 0
    p_pairs = 0.0
    for c in plan.chunks:
        n, p = c.num_new_tokens, c.num_context_tokens
        if c.is_prefill:
            p_tokens, p_context, p_pairs = p_tokens + n, p_context + p, p_pairs + n * p + n * (n + 1) / 2
        else:
            tokens, context, pairs = tokens + n, context + p, pairs + n * p + n * (n + 1) / 2
    return (tokens, context, pairs), (p_tokens, p_context, p_pairs)


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

    def __init__(
        self,
        scale: float,
        model: ModelSpec | str,
        gpu: GPUSpec | str = "h100",
        tp: int = 1,
        kv_dtype: str = "bf16",
        weight_dtype: str = "bf16",
        calibration: Calibration = Calibration(),
    ) -> None:
        """``scale`` = k, then ``Roofline``'s own arguments (the full-size deployment's), spelled
        out: mypyc miscompiles ``*args, **kwargs`` passed on to a compiled ``__init__``."""
        super().__init__(model, gpu, tp, kv_dtype, weight_dtype, calibration)
        self.scale = scale
        self._prefill: tuple[float, float, float] = (0.0, 0.0, 0.0)  # averaged tokens, context, pairs of prefill beside decodes

    def batch_cost(self, tokens: int, context: int, pairs: float) -> StepCost:
        k = self.scale
        return super().batch_cost(round(tokens * k), round(context * k), pairs * k)

    def cost(self, plan: StepPlan) -> StepCost:
        (tokens, context, pairs), prefill = work(plan)
        if not tokens:  # no decode to hide prefill behind: as it comes
            return self.batch_cost(*prefill)
        return self._decoding(tokens, context, pairs, prefill)

    def batch_seconds(self, tokens: int, context: int, pairs: float) -> float:
        """A fast-forwarded decode step: no prefill of its own, the average beside it (it
        decays by one prefill-free step, as ``cost`` of that step's plan would have it: the
        engine loop times exactly the steps it then takes)."""
        return self._decoding(tokens, context, pairs, (0, 0, 0.0)).seconds

    def _decoding(self, tokens: int, context: int, pairs: float, prefill: Work) -> StepCost:
        a = 1.0 / PREFILL_SMOOTHING_STEPS
        (m_tokens, m_context, m_pairs), (x_tokens, x_context, x_pairs) = self._prefill, prefill
        avg = (m_tokens + a * (x_tokens - m_tokens), m_context + a * (x_context - m_context), m_pairs + a * (x_pairs - m_pairs))
        self._prefill = avg
        return self.batch_cost(tokens + round(avg[0]), context + round(avg[1]), pairs + avg[2])


def _attn_flops_per_pair(m: ModelSpec) -> float:
    """FLOPs per (query, key) pair over all layers: 2·d for QKᵀ plus 2·d for AV per head.

    MLA is counted in the absorbed form both engines' decode kernels use: queries meet the
    cached latent directly (QKᵀ over kv_lora_rank + rope dims, AV over kv_lora_rank)."""
    if m.mla:
        latent = m.kv_lora_rank + (m.qk_rope_head_dim or 0)  # type: ignore[operator]
        return 2 * m.heads * m.layers * (latent + m.kv_lora_rank)  # type: ignore[operator]
    return 4 * m.heads * m.head_dim * m.layers


def _routed_expert_params(m: ModelSpec) -> float:
    """Parameters in routed experts (read only where tokens are routed); 0 for dense models."""
    if not m.experts:
        return 0.0
    width = m.moe_intermediate or m.intermediate
    return float((m.layers - m.dense_layers) * m.experts * 3 * m.hidden * width)


@dataclass(frozen=True)
class StepLaw:
    """A step's seconds as a linear law of its work, fitted to an engine's own metrics:

        t = fixed + per_decode·B + per_context·C + per_prefill·P

    B requests decoding one token each, over C cached context tokens in all, beside P prompt
    tokens prefilled. Engines on hardware with no preset (a CPU, a GPU kvdiag does not list) run
    steps whose cost is per-step overhead plus per-token work, which is what this says."""

    fixed: float
    per_decode: float
    per_context: float
    per_prefill: float

    def seconds(self, decodes: float, context: float, prefill: float) -> float:
        if not decodes and not prefill:
            return 0.0
        return self.fixed + self.per_decode * decodes + self.per_context * context + self.per_prefill * prefill


pickle_by_fields(StepLaw)


class LinearStep(Roofline):
    """``Roofline``'s interface over a ``StepLaw`` (a subclass, so that the compiled engine loop
    and topologies take it where they take a roofline): the model spec still gives the KV bytes
    per token the metrics report; ``scale`` = k times a scale model's batch as the full-size one
    (``ScaledRoofline``'s rule, without its prefill averaging: a linear law has no ridge to hide
    prefill behind)."""

    def __init__(self, law: StepLaw, model: ModelSpec | str, tp: int = 1, kv_dtype: str = "bf16", scale: float = 1.0) -> None:
        super().__init__(model, "h100", tp, kv_dtype)
        self.law = law
        self.scale = scale

    def cost(self, plan: StepPlan) -> StepCost:
        (tokens, context, _), (p_tokens, _, _) = work(plan)
        return self._cost(tokens, context, p_tokens)

    def batch_cost(self, tokens: int, context: int, pairs: float) -> StepCost:
        return self._cost(tokens, context, 0)

    def _cost(self, decodes: int, context: int, prefill: int) -> StepCost:
        k = self.scale
        seconds = self.law.seconds(decodes * k, context * k, prefill * k)
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, seconds)
