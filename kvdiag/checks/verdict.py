"""From check results to the verdict (the decision table) and the findings.

Each capacity signal (S, Q, E) is firing, ok or unknown. The verdict is the table's row when
all three are known. When some are unknown, every way of filling them in is tried: if all give
the same verdict that is the answer (an idle engine without an eviction counter is still
healthy). If they differ but every one of them names the pool (``VerdictSpec.names_pool``: a
pinned pool with its eviction counter missing is near capacity or under pressure), the known
signals already settle that the pool is the answer: the verdict is the least of them, the
unknown signals read as not firing, and the reason says what they could raise it to. Otherwise
the verdict is ``unknown`` and says which signal would decide it.
"""

from __future__ import annotations

from itertools import product
from typing import Mapping

from kvdiag.checks.catalog import FINDINGS, SIGNALS, VERDICTS, Row, verdict_for
from kvdiag.config import Config
from kvdiag.model import CheckResult, Finding, Verdict


def decide(checks: Mapping[str, CheckResult], config: Config) -> Verdict:
    status = {sig: checks[name].status for sig, name in SIGNALS.items()}
    unknown = [sig for sig, st in status.items() if st == "unknown"]
    choices = [(True, False) if st == "unknown" else (st == "firing",) for st in status.values()]
    rows = {verdict_for(combo).verdict: verdict_for(combo) for combo in product(*choices)}
    if len(rows) > 1 and all(VERDICTS[v].names_pool for v in rows):
        least = verdict_for(tuple(st == "firing" for st in status.values()))  # type: ignore[arg-type]
        return _settled(least, rows, unknown, status, checks, config)
    if len(rows) > 1:
        by_reason: dict[str, list[str]] = {}
        for sig in unknown:
            by_reason.setdefault(_why(checks[SIGNALS[sig]]), []).append(SIGNALS[sig])
        why = "; ".join(f"{' and '.join(names)} unknown ({reason})" for reason, names in by_reason.items())
        return _verdict("unknown", f"{why}; the answer would be one of {', '.join(sorted(rows))}")
    (row,) = rows.values()
    fired = [SIGNALS[s] for s in SIGNALS if status[s] == "firing"]
    reason = f"{row.meaning} [{', '.join(fired) or 'no capacity signal'} firing"
    not_firing = [SIGNALS[s] for s in SIGNALS if status[s] == "ok"]
    if fired and not_firing:
        reason += f"; not firing: {', '.join(not_firing)}"
    reason += "]"
    if unknown:
        reason += f"; {', '.join(SIGNALS[s] for s in unknown)} unknown, but the answer is the same either way"
    notes = _usage_note(row.verdict, checks, config) + _deferred_note(checks) + _role_note(row.verdict, checks)
    return _verdict(row.verdict, reason + notes)


def _settled(least: Row, rows: Mapping[str, Row], unknown: list[str], status: Mapping[str, str],
             checks: Mapping[str, CheckResult], config: Config) -> Verdict:
    """The least pool verdict the known signals prove, where the unknown ones could only raise it."""
    fired = [SIGNALS[s] for s in SIGNALS if status[s] == "firing"]
    higher = sorted(v for v in rows if v != least.verdict)
    names = " and ".join(SIGNALS[s] for s in unknown)
    reason = (f"{least.meaning} [{', '.join(fired)} firing]; {names} unknown ({_why(checks[SIGNALS[unknown[0]]])}): "
              f"the pool is the answer either way, {' or '.join(higher)} if {'they fire' if len(unknown) > 1 else 'it fires'}")
    return _verdict(least.verdict, reason + _usage_note(least.verdict, checks, config) + _role_note(least.verdict, checks))


def findings(verdict: Verdict, checks: Mapping[str, CheckResult]) -> list[Finding]:
    """The catalog's findings whose conditions hold: all of its checks firing, the excluded
    ones known not to fire, and (where it says) one of its verdicts."""
    out = []
    for spec in FINDINGS.values():
        if spec.verdicts and verdict.name not in spec.verdicts:
            continue
        if all(checks[c].status == "firing" for c in spec.all_of) and all(checks[c].status == "ok" for c in spec.none_of):
            out.append(Finding(spec.name, spec.severity, spec.alert, spec.summary))
    return out


def _verdict(name: str, reason: str) -> Verdict:
    spec = VERDICTS[name]
    return Verdict(name, spec.severity, spec.exit_code, spec.alert, reason)


def _why(result: CheckResult) -> str:
    return result.evidence.summary or ", ".join(result.missing)


#: What a full pool means on each role of a disaggregated pair (a unified instance needs no note).
ROLE_NOTES = {
    "decode": "this is the decode instance of a disaggregated pair: its pool holds the running decodes and the "
              "room pre-allocated for arriving KV, so it wants decode capacity (more or larger decode instances, "
              "a smaller KV per token), not more prefill",
    "prefill": "this is the prefill instance of a disaggregated pair: its pool holds prompts being prefilled and KV "
               "waiting to be sent, so it wants prefill capacity or a faster transfer to the decode side",
}


def _role_note(verdict: str, checks: Mapping[str, CheckResult]) -> str:
    """An L1 verdict on one role of a disaggregated pair, said in that role's terms."""
    role = checks[SIGNALS["Q"]].evidence.values.get("role")
    if verdict not in ("l1_kv_bottleneck", "l1_kv_pressure", "near_kv_capacity") or not isinstance(role, str):
        return ""
    note = ROLE_NOTES.get(role)
    return f". {note[0].upper()}{note[1:]}" if note else ""


def _deferred_note(checks: Mapping[str, CheckResult]) -> str:
    """Where most of a firing queue is deferred work (its KV transfer, the other instance of a
    disaggregated pair), say so: those requests do not wait for this pool or its scheduler."""
    q = checks[SIGNALS["Q"]]
    if q.status != "firing":
        return ""
    waiting, deferred = q.evidence.values.get("waiting_last"), q.evidence.values.get("waiting_deferred_last")
    names = q.evidence.values.get("deferred_queues")
    if not isinstance(waiting, float) or not isinstance(deferred, float) or not waiting or deferred < waiting / 2:
        return ""
    capacity = q.evidence.values.get("waiting_capacity_last")
    room = f" ({capacity:.0f} wait for scheduling room)" if isinstance(capacity, float) else ""
    return (f". {deferred:.0f} of the {waiting:.0f} waiting requests are {names or 'deferred'}{room}: deferred work, "
            "not held back by this pool, the admission limit, the token budget or compute")


def _usage_note(verdict: str, checks: Mapping[str, CheckResult], config: Config) -> str:
    """What the usage gauge says when the table's answer does not rest on it.

    Queueing with usage high but not pinned: an admission that reserves room for the
    running requests' future output and can refuse work below a pinned gauge. Pressure from
    queue and evictions without S: a usage spike the sampled gauge caught only briefly.
    """
    s = checks[SIGNALS["S"]]
    if s.status != "ok":
        return ""
    peak = s.evidence.values.get("usage_max")
    if not isinstance(peak, float):
        return ""
    if verdict == "queue_without_kv_pressure" and peak >= config.high_usage:
        ratio = checks[SIGNALS["Q"]].evidence.values.get("decode_reserve_ratio")
        reserve = f" (this engine reports a reserve ratio of {ratio:.2f})" if isinstance(ratio, float) else ""
        return (
            f". Usage reached {peak:.2f} without being pinned (>= {config.high_usage:g}): admission that "
            f"reserves KV for running requests' future output{reserve} can block below a pinned gauge"
        )
    need = s.evidence.values.get("need_ratio_last")
    admission_peak = min(1.0, peak + need) if isinstance(need, float) else peak
    if verdict == "l1_kv_pressure" and admission_peak >= config.saturated_usage:
        share = s.evidence.values.get("share_at_or_above")
        if s.evidence.values.get("reached_before_short_window"):
            return (f". Admission usage reached {admission_peak:.2f} again and again but stayed >= {config.saturated_usage:g} "
                    f"in only {share:.0%} of samples: the gauge dips between peaks (an eviction frees its victim's KV at "
                    "once) while the pool keeps running out")
        return f". Admission usage touched {admission_peak:.2f} but stayed >= {config.saturated_usage:g} in only {share:.0%} of samples: a short spike is pressure, not a pinned pool"
    return ""
