"""The main job: `kvdiag demo --no-live` runs the exporter on both simulated engines and reads
them to the L1 verdict: the reference engines' own story, not a script. Run as a newcomer
would pipe it: 80 columns, not a terminal."""

from __future__ import annotations

import re
import subprocess
import sys

from kvdiag.checks import catalog
from tests.conftest import hang_guard

WALL_SECONDS = 20


def test_demo_reaches_the_l1_verdicts_on_the_reference_engines() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvdiag", "demo", "--no-live", "--duration", str(WALL_SECONDS), "--speed", "20", "--interval", "0.25"],
        capture_output=True, text=True, timeout=hang_guard(30), env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    ticks = [line for line in lines if line.startswith("t=")]
    # one line per instance per tick, whole: every field on it, the verdict last
    record = re.compile(
        r"t=\s*(\d+)s (sglang|vllm)\s+usage=\S+ running=\S+ waiting=\S+ evictions=\S+ \(\S+/min\) "
        r"hit=(\S+) L2=(\S+) p99_ttft=\S+s verdict=(\w+)$"
    )
    parsed = [record.match(line) for line in ticks]
    assert ticks and all(parsed), [t for t, m in zip(ticks, parsed) if not m][:3]
    verdicts: dict[str, list[str]] = {}
    for m in parsed:
        assert m is not None and m.group(5) in catalog.VERDICTS
        verdicts.setdefault(m.group(2), []).append(m.group(5))
        for ratio in (m.group(3), m.group(4)):
            assert ratio == "—" or 0 <= float(ratio) <= 1, m.group(0)  # never an impossible ratio
    assert set(verdicts) == {"sglang", "vllm"}
    # vLLM preempts and recomputes; SGLang's admission first blocks on its output reserve, before any retraction
    reached = {"vllm": "l1_kv_bottleneck", "sglang": "l1_kv_pressure"}
    for engine, seen in verdicts.items():
        assert "healthy" in seen, (engine, seen)  # it starts healthy ...
        assert reached[engine] in seen and seen.index("healthy") < seen.index(reached[engine]), (engine, seen)  # ... reads L1 ...
        assert seen[-1] in ("l1_kv_bottleneck", "l1_kv_pressure"), (engine, seen)  # ... and ends on L1
    assert "l1_kv_bottleneck" not in verdicts["sglang"][: verdicts["sglang"].index("l1_kv_pressure")]
    assert any(m and m.group(2) == "sglang" and m.group(4) != "—" for m in parsed)  # SGLang's L2 is shown
    assert any(m and m.group(3) != "—" for m in parsed)  # so is the hit ratio
    # one time base: the story's. t= and the checks' spans are simulated seconds, far past the wall run
    assert max(int(m.group(1)) for m in parsed if m) > 5 * WALL_SECONDS
    spans = [int(s) for s in re.findall(r"over (\d+)s", proc.stdout)]
    assert spans and max(spans) > 5 * WALL_SECONDS, spans
    assert re.search(r"exporter: http://127\.0\.0\.1:\d+/ \(page\), http://127\.0\.0\.1:\d+/api/v1/verdicts \(API\)", proc.stdout)
    assert "Admission limit" in proc.stdout and "--max-num-seqs" in proc.stdout and "--max-running-requests" in proc.stdout
    assert proc.stdout.count("meta-llama/Meta-Llama-3-70B-Instruct") >= 2  # the model, whole, in each diagnosis
    assert "…" not in proc.stdout
    assert all(len(line) <= 80 for line in lines if not line.startswith(("t=", "exporter:", "sglang http")))


class _NoInstances:
    """An exporter that has read nothing yet: the live view shows its header alone."""

    def instances(self) -> list:
        return []


def test_a_piped_live_view_ends_its_last_frame_with_a_newline() -> None:
    """In a pipe the live view's last frame and whatever follows (the report) are separate lines."""
    import io

    from rich.console import Console

    from kvdiag.report.live import deadline, watch

    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    watch(console, _NoInstances(), {}, deadline(0.0), interval=0.0, live_view=True, header="story t={t:.0f}s")
    console.print("REPORT")
    lines = out.getvalue().splitlines()
    assert "story t=" in out.getvalue()  # the live view drew a frame
    assert "REPORT" in lines
