"""The remedies as changes to a scenario: smaller KV per token, more L1, admission control.

More L1 comes three ways: the pool set directly (``pool``: SGLang ``--max-total-tokens``, vLLM
``--num-gpu-blocks-override``), a higher memory fraction, or TP / DP. Admission is capped by
``max-running`` and, on SGLang, loosened or tightened by ``conservativeness``
(``--schedule-conservativeness``: it scales the new-token ratio, the share of running requests'
future output that admission reserves).

A lever maps a ``Scenario`` (fitted from an incident, or one of the catalogue's) to the same
scenario with the remedy applied. One function gives both sides of validate's what-if pairs:
the prediction (the lever on the fitted scenario) and the truth (the lever on the scenario the
metrics came from). The pool a deployment lever gives is the capacity model's ratio applied to
the pool the engine reported (``deployment.Sized``): the reported pool stays exact, only the
change is modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping

from kvdiag import engines
from kvdiag.capacity import DTYPE_BYTES
from kvdiag.refpool.scenarios import Deployment, Scenario
from kvdiag.whatif.deployment import sized
from kvdiag.refpool.workload import Arrivals, Bursty, Periodic, Poisson, Ramp, Workload

#: A data-parallel replica's seed is its workload's seed plus this times its rank.
REPLICA_SEED = 7919


class LeverError(ValueError):
    """A remedy that cannot be applied as given (unknown name, bad value, no room left)."""


@dataclass(frozen=True)
class Lever:
    """One remedy: ``name=value`` as ``--remedy`` takes it, and why it was proposed."""

    name: str
    value: str
    why: str = ""

    @property
    def label(self) -> str:
        return f"{self.name}={self.value}"

    def apply(self, scenario: Scenario) -> Scenario:
        """``scenario`` with this remedy applied (``LeverError`` when it leaves no pool)."""
        out = APPLY[self.name](scenario, self.value)
        try:
            if out.deployment.pool_tokens <= 0:
                raise LeverError(f"{self.label} leaves no KV pool")
        except ValueError as exc:  # the capacity model: weights leave no room
            raise LeverError(f"{self.label}: {exc}") from None
        return out

    def flag(self, engine: str) -> str:
        """The engine's own flag for this lever, for the report ("" where it has none)."""
        try:
            k = engines.knobs(engine)
        except KeyError:
            return ""
        flags = {"max-running": k.admission_limit, "mem-fraction": k.memory_fraction, "kv-dtype": k.kv_dtype_fp8,
                 "tp": k.tensor_parallel, "dp": k.data_parallel, "pool": k.kv_pool_size,
                 "conservativeness": k.reserve_conservativeness}  # fmt: skip
        return flags.get(self.name, "")


def _deploy(**change: object) -> Callable[[Scenario], Scenario]:
    return lambda sc: replace(sc, deployment=replace(sized(sc.deployment), **change))


def _positive_int(value: str, name: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise LeverError(f"{name}={value!r}: expected a whole number") from None
    if n < 1:
        raise LeverError(f"{name}={value}: must be at least 1")
    return n


def _fraction(value: str, name: str, high: float) -> float:
    try:
        f = float(value)
    except ValueError:
        raise LeverError(f"{name}={value!r}: expected a number") from None
    if not 0 < f <= high:
        raise LeverError(f"{name}={value}: must be in (0, {high:g}]")
    return f


def _kv_dtype(sc: Scenario, value: str) -> Scenario:
    if value not in DTYPE_BYTES:
        raise LeverError(f"kv-dtype={value!r}: expected one of {', '.join(DTYPE_BYTES)}")
    return _deploy(kv_dtype=value)(sc)


def _pool(sc: Scenario, value: str) -> Scenario:
    """The pool set to ``value`` tokens as the engine would report it, whatever the deployment
    (the capacity model's later changes, FP8 say, scale from it)."""
    n = _positive_int(value, "pool")
    d = sized(sc.deployment)
    base = replace(d, reported_pool=None, reported_as=None, scale=1.0)
    return replace(sc, deployment=replace(d, reported_pool=n, reported_as=base))


def _conservativeness(sc: Scenario, value: str) -> Scenario:
    try:
        f = float(value)
    except ValueError:
        raise LeverError(f"conservativeness={value!r}: expected a number") from None
    if not f >= 0:  # SGLang's own check (validation_hook: non-negative)
        raise LeverError(f"conservativeness={value}: must be at least 0")
    return replace(sc, sglang_conservativeness=f)


def _dp(sc: Scenario, value: str) -> Scenario:
    """Each DP engine's load spread over ``value`` replicas (a router splitting it evenly)."""
    n = _positive_int(value, "dp")

    def split(wls: tuple[Workload, ...]) -> tuple[Workload, ...]:
        return tuple(replace(w, arrivals=thinned(w.arrivals, n), seed=w.seed + REPLICA_SEED * k) for w in wls for k in range(n))

    return replace(sc, workloads=split(sc.workloads), intent=sc.intent * n,
                   workloads_by_engine={e: split(w) for e, w in sc.workloads_by_engine.items()},
                   intent_by_engine={e: i * n for e, i in sc.intent_by_engine.items()})  # fmt: skip


def thinned(arrivals: Arrivals, n: float) -> Arrivals:
    """The arrival process one of ``n`` replicas sees (every rate divided by ``n``)."""
    if isinstance(arrivals, (Poisson, Periodic)):
        return replace(arrivals, rate=arrivals.rate / n)
    if isinstance(arrivals, Ramp):
        return Ramp(tuple((t, r / n) for t, r in arrivals.points))
    if isinstance(arrivals, Bursty):
        return replace(arrivals, burst_rate=arrivals.burst_rate / n, calm_rate=arrivals.calm_rate / n)
    scaled = getattr(arrivals, "scaled", None)
    if scaled is None:
        raise LeverError(f"dp: cannot split {type(arrivals).__name__} arrivals over replicas")
    return scaled(1.0 / n)  # type: ignore[no-any-return]


APPLY: dict[str, Callable[[Scenario, str], Scenario]] = {
    "max-running": lambda sc, v: replace(sc, max_running=_positive_int(v, "max-running")),
    "mem-fraction": lambda sc, v: _deploy(mem_fraction=_fraction(v, "mem-fraction", 1.0))(sc),
    "kv-dtype": _kv_dtype,
    "tp": lambda sc, v: _deploy(tp=_positive_int(v, "tp"))(sc),
    "dp": _dp,
    "l2-ratio": lambda sc, v: replace(sc, l2_ratio=_fraction(v, "l2-ratio", 1e6)),
    "pool": _pool,
    "conservativeness": _conservativeness,
}


def parse(text: str) -> tuple[str, str | None]:
    """``NAME[=VALUE]`` from ``--remedy``: the name checked, the value as given (None: the
    default lever of that name)."""
    name, _, value = text.partition("=")
    name = name.strip()
    if name not in APPLY:
        raise LeverError(f"--remedy {text!r}: unknown remedy {name!r}; known: {', '.join(APPLY)}")
    return name, (value.strip() or None)


def defaults(deployment: Deployment, admission_limit: int | None) -> list[Lever]:
    """The default remedies for an instance: FP8 KV, twice the L1 by TP, one more DP replica,
    the recommended admission limit (where the checklist could compute it) and a higher memory
    fraction."""
    d = sized(deployment)
    out = []
    if d.kv_dtype != "fp8":
        out.append(Lever("kv-dtype", "fp8", "half the KV bytes per token: twice the tokens in the same pool"))
    out.append(Lever("tp", str(2 * d.tp), "twice the GPUs per replica: more than twice the pool (weights split too)"))
    out.append(Lever("dp", "2", "one more data-parallel replica: half the load per pool"))
    if admission_limit:
        out.append(Lever("max-running", str(admission_limit), "the checklist's recommended admission limit"))
    higher = round(min(0.98, d.mem_fraction + 0.05), 2)
    if higher > d.mem_fraction:
        out.append(Lever("mem-fraction", f"{higher:g}", f"a higher static memory fraction than {d.mem_fraction:g}"))
    return out


def recommended_limit(figures: Mapping[str, object]) -> int | None:
    """The checklist's recommended admission limit from a diagnosis' figures (``checks.remedies``:
    ``limit``, or ``ceiling`` where a checklist gives no separate limit); None where unknown."""
    value = figures.get("limit", figures.get("ceiling"))
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def resolve(requested: list[str], deployment: Deployment, admission_limit: int | None) -> list[Lever]:
    """The levers ``--remedy`` asks for (the defaults when none): a bare name takes its default
    value, and a name with no default (l2-ratio, or max-running without a ceiling) needs one."""
    if not requested:
        return defaults(deployment, admission_limit)
    by_name = {lv.name: lv for lv in defaults(deployment, admission_limit)}
    out = []
    for text in requested:
        name, value = parse(text)
        if value is None:
            if name not in by_name:
                raise LeverError(f"--remedy {name}: give a value ({name}=VALUE); no default could be derived")
            out.append(by_name[name])
        else:
            out.append(Lever(name, value, "asked for"))
    return out
