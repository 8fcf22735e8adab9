"""``promtool test rules`` on the committed rules, for tests that build their own groups of
input series and expected answers (the deployments' stories, LMCache's joins)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from kvdiag.render import RULES_ALERTS, RULES_RECORDING
from kvdiag.render.rules import groups as rule_groups
from tests.mixin.conftest import ROOT, need
from tests.mixin.test_differential import INTERVAL
from tests.mixin.test_promtool import _without_annotations


def run_rule_tests(groups: list[dict], tmp_path: Path, name: str, timeout: float = 600,
                   recording: Path = ROOT / RULES_RECORDING) -> None:
    """The groups (promtool's ``tests``), evaluated every 15 s with the recording rules (the
    committed ones unless ``recording`` names others) and the alerts (annotations left out) in
    their groups' order; fails with promtool's report."""
    promtool = need("promtool")
    doc = {
        "rule_files": [str(recording), str(_without_annotations(ROOT / RULES_ALERTS, tmp_path / "alerts.yaml"))],
        "evaluation_interval": f"{int(INTERVAL)}s",
        "group_eval_order": rule_groups(),
        "tests": groups,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=100_000))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-12000:] + out.stderr[-2000:]
