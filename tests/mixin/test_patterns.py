"""Every status pattern through the committed rules: the recorded pattern and the alerts.

The alerts read the decision's three statuses as one recorded number
(``instance:kvdiag_check:pattern``) and test it against a bit mask per verdict. The
differential (``test_differential.py``) meets only the patterns the catalogue's stories reach;
here all 27 (firing / ok / unknown for each signal) are given to promtool as check statuses of
27 instances, and each instance must carry exactly the verdict alert that the Python decision
gives for its pattern, and the findings' alerts where the finding may accompany that verdict.
"""

from __future__ import annotations

from itertools import product
from pathlib import Path

from kvdiag.checks.catalog import FINDINGS, SIGNALS, VERDICTS
from kvdiag.config import Config
from kvdiag.render.promql import Labels
from kvdiag.render.rules import CHECKS_GROUP, PATTERN, _decided, dump, pattern_code, pattern_rule
from tests.mixin.rule_tests import run_rule_tests

STATES = ("firing", "ok", "unknown")
LABELS = {"job": "kvdiag-patterns", "model_name": "m", "engine": "0", "dp_rank": "0"}
ALERTS = "|".join(a for a in [v.alert for v in VERDICTS.values()] + [f.alert for f in FINDINGS.values()] if a)


def _name(name: str, instance: str, **extra: str) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in {**LABELS, "instance": instance, **extra}.items()) + "}"


def _series(name: str, instance: str, value: float, **extra: str) -> dict:
    return {"series": _name(name, instance, **extra), "values": f"{value:g}x8"}


def test_every_status_pattern_gives_the_python_verdicts_alert(tmp_path: Path) -> None:
    inputs, codes, alerts = [], [], []
    reached: set[str] = set()
    findings = [f for f in FINDINGS.values() if f.alert]
    for pattern in product(STATES, repeat=len(SIGNALS)):
        instance = "engine-" + "-".join(pattern)
        inputs += [_series("instance:kvdiag_instance:info", instance, 1),
                   _series("instance:kvdiag_running:requests", instance, 1),
                   _series("instance:kvdiag_waiting:requests", instance, 0)]
        for check, state in zip(SIGNALS.values(), pattern):
            if state != "unknown":
                inputs.append(_series("instance:kvdiag_check:status", instance, int(state == "firing"), check=check))
        for f in findings:  # every finding's own checks hold, so only its verdicts decide
            for check in f.all_of:
                inputs.append(_series("instance:kvdiag_check:status", instance, 1, check=check))
            for check in f.none_of:
                inputs.append(_series("instance:kvdiag_check:status", instance, 0, check=check))
        codes.append({"labels": _name(PATTERN, instance), "value": pattern_code(pattern)})
        verdict = _decided(pattern, Config())  # the Python decision itself
        expected = [VERDICTS[verdict].alert] + [f.alert for f in findings if not f.verdicts or verdict in f.verdicts]
        alerts += [{"labels": f'{{alertname="{a}",instance="{instance}"}}', "value": 1} for a in expected if a]
        reached.update(a for a in expected if a)
    assert len(reached) >= 5, f"the patterns reach too few alerts to test the masks: {sorted(reached)}"
    # the checks group as rendered, less the checks themselves (their statuses are the inputs here)
    rule = pattern_rule(Labels())
    recording = tmp_path / "pattern.yaml"
    recording.write_text(dump({"groups": [{"name": CHECKS_GROUP, "rules": [{"record": rule.record, "expr": rule.expr}]}]}))
    run_rule_tests([{
        "name": "every status pattern",
        "interval": "15s",
        "input_series": inputs,
        "promql_expr_test": [
            {"expr": PATTERN, "eval_time": "1m", "exp_samples": codes},
            {"expr": f'group by (alertname, instance) (ALERTS{{alertname=~"{ALERTS}"}})', "eval_time": "1m", "exp_samples": alerts},
        ],
    }], tmp_path, "patterns", recording=recording)
