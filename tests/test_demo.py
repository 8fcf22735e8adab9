"""The main job: `kvdiag demo --no-live` runs the exporter on both simulated engines and reads
them to the L1 verdict: the reference engines' own story, not a script."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_reaches_the_l1_verdicts_on_the_reference_engines() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvdiag", "demo", "--no-live", "--duration", "18", "--speed", "30", "--interval", "0.25"],
        capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    verdicts: dict[str, list[str]] = {}
    for engine, verdict in re.findall(r"t=\s*\d+s (\w+)\s.*verdict=(\w+)", proc.stdout):
        verdicts.setdefault(engine, []).append(verdict)
    assert set(verdicts) == {"sglang", "vllm"}
    # vLLM preempts and recomputes; SGLang's admission blocks on its output reserve, no retraction
    final = {"vllm": "l1_kv_bottleneck", "sglang": "l1_kv_pressure"}
    for engine, seen in verdicts.items():
        assert "healthy" in seen, (engine, seen)  # it starts healthy ...
        assert seen[-1] == final[engine], (engine, seen)  # ... and ends on its L1 verdict
        assert seen.index("healthy") < seen.index(final[engine])
    assert re.search(r"exporter: http://127\.0\.0\.1:\d+/ \(page\), http://127\.0\.0\.1:\d+/api/v1/verdicts \(API\)", proc.stdout)
    assert "Admission limit" in proc.stdout and "--max-num-seqs" in proc.stdout and "--max-running-requests" in proc.stdout
