"""The real-engine harness's parts that need no engine: the truth file's reading, the script's
environment key, the story catalogue's pools (each fast; the engines run in test_real_engines.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvdiag.cli import main
from kvdiag.real import envs
from kvdiag.real.catalogue import CI_STORY, STORIES
from kvdiag.real.load import ClosedLoop, Driver, Overload, Record, Requests
from kvdiag.real.truth import MAX_STEP_S, Tail, TruthError, read
from tests.conftest import hang_guard

T0 = 1_800_000_000.0


def _write(path: Path, rows: list[list]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_steps_last_until_the_next_and_a_pause_is_idle_time(tmp_path: Path) -> None:
    """A step stands until the next, at most MAX_STEP_S; the rest of a pause (the hook writes no
    idle step), before the first step and after the last, is idle: nothing refused or waiting."""
    f = _write(tmp_path / "t.jsonl", [
        [T0 + 2.0, 0, "", 0, 1, 0, 0.1], [T0 + 2.25, 1, "", 0, 4, 3, 0.97], [T0 + 5.0, 0, "seqs", 0, 16, 2, 0.5],
    ])  # fmt: skip
    steps = read(f, T0, T0 + 10)
    c = steps.columns
    assert list(c["start"]) == pytest.approx([0.0, 2.0, 2.25, 2.25 + MAX_STEP_S, 5.0, 5.0 + MAX_STEP_S])
    assert list(c["duration"]) == pytest.approx([2.0, 0.25, MAX_STEP_S, 2.75 - MAX_STEP_S, MAX_STEP_S, 5.0 - MAX_STEP_S])
    assert list(c["blocked_on_kv"]) == [False, False, True, False, False, False]
    assert list(c["waiting"]) == [0, 0, 3, 0, 2, 0] and list(c["running"]) == [0, 1, 4, 0, 16, 0]
    assert steps.first_kv_refusal() == pytest.approx(2.25)
    assert steps.limit(0, 10) == "kv"  # 1 s blocked on KV against 1 s on the cap: the first wins ties
    assert steps.limit(4, 10) == "seqs"
    assert steps.share("kv") == pytest.approx(0.1)  # of the span's 10 s, not of the 2.25 s the engine was busy
    assert list(read(f, T0 + 2, float("inf")).columns["duration"]) == pytest.approx([0.25, MAX_STEP_S, 2.75 - MAX_STEP_S, MAX_STEP_S])


def test_a_preemption_while_requests_wait_is_blocked_on_kv(tmp_path: Path) -> None:
    """vLLM skips the waiting queue in a step that preempted: the pool ran out."""
    f = _write(tmp_path / "t.jsonl", [[T0 + 1, 0, "", 2, 5, 7, 0.9], [T0 + 2, 0, "", 1, 5, 0, 0.9]])
    steps = read(f, T0 + 1, T0 + 3)
    assert list(steps.columns["blocked_on_kv"]) == [True, False]
    assert int(steps.columns["evicted"].sum()) == 3


def test_only_the_span_is_read_and_per_second_rows_sum_it_up(tmp_path: Path) -> None:
    rows = [[T0 + k * 0.25, int(k % 2), "" if k % 2 else "budget", 0, 3, 2, 0.5] for k in range(40)]
    steps = read(_write(tmp_path / "t.jsonl", rows), T0 + 2, T0 + 6)
    assert len(steps) == 16 and steps.t0 == T0 + 2
    per = steps.per_second()
    assert [r["t"] for r in per] == [0, 1, 2, 3]
    assert all(r["kv_blocked"] == 0.5 and r["cap_budget"] == 0.5 and r["waiting"] == 2 for r in per[:3])


def test_a_bad_line_is_an_error_but_a_half_written_last_line_is_not(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps([T0, 1, "", 0, 1, 1, 0.9]) + "\n[1800000001.0, 0, ")
    assert len(read(f, T0, T0 + 1)) == 1
    f.write_text("not json\n" + json.dumps([T0, 1, "", 0, 1, 1, 0.9]) + "\n")
    with pytest.raises(TruthError, match=r"t.jsonl:1: not a truth line"):
        read(f, T0, T0 + 10)
    absent = read(tmp_path / "absent.jsonl", T0, T0 + 10)
    assert list(absent.columns["duration"]) == [10.0] and absent.first_kv_refusal() is None  # idle throughout
    f.write_text(json.dumps([T0, 1, "", 0, 1, 1, 0.9]) + "\n" + json.dumps(["error", "AttributeError: x"]) + "\n")
    with pytest.raises(TruthError, match=r"t.jsonl:2: the truth hook failed in the engine: .*AttributeError: x"):
        read(f, T0, T0 + 10)
    f.write_text(json.dumps([T0, 1, "", 0]) + "\n\n")
    with pytest.raises(TruthError, match=r"t.jsonl:1: not a truth line \(not enough values"):
        read(f, T0, T0 + 10)


def test_the_environment_is_keyed_by_its_pinned_requirements() -> None:
    for engine in envs.ENGINES:
        req = envs.ROOT / "scripts" / "real" / f"{engine}.txt"
        digest = hashlib.sha256(req.read_bytes()).hexdigest()[:12]
        assert envs.location(engine).name == f"{engine}-{digest}"
        pins = [l for l in req.read_text().splitlines() if l and not l.startswith("#")]
        assert all("==" in p for p in pins), [p for p in pins if "==" not in p]
        assert "torch==2.13.0+cpu" in pins  # never a CUDA torch
        assert not any(p.split("==")[0] in ("torchaudio", "torchcodec") for p in pins)
    done = subprocess.run(["bash", str(envs.SCRIPT), "--path", "tensorrt"], capture_output=True, text=True)
    assert done.returncode == 2 and "no engine 'tensorrt'" in done.stderr


def test_every_story_fits_its_engines_and_ci_tells_one_on_each() -> None:
    assert set(STORIES[CI_STORY].engines) == set(envs.ENGINES)
    for story in STORIES.values():
        for engine in story.engines:
            spec = story.spec(engine)  # raises where vLLM's pool is not whole blocks above the context
            assert spec.pool_tokens >= story.shape.prompt[1] + story.shape.output[1] + story.shape.extra_max_tokens
        assert story.seconds >= 120, f"{story.name}: scored instants start after the first minute"


def test_validate_keeps_real_and_simulated_stories_apart(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--real", "--scenario", "l1-saturation"]) == 3
    assert "not a real story" in capsys.readouterr().err
    assert main(["validate", "--scenario", CI_STORY]) == 3
    assert "a real story (use --real)" in capsys.readouterr().err
    assert main(["validate", "--calibrate", "--scenario", "closed-loop"]) == 3  # a calibration compares real runs
    assert "needs --real" in capsys.readouterr().err


def test_the_engine_side_import_hook_runs_after_its_module_and_leaves_others_alone() -> None:
    """sitecustomize's finder (what installs the truth hook in an engine's processes): the
    callback sees the module once it has executed; other imports are untouched."""
    from kvdiag.real.engines import SITE

    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import sitecustomize as s\n"
        "h = s._Hooks(); seen = []\n"
        "h.after['json.decoder'] = lambda m: seen.append((m.__name__, hasattr(m, 'JSONDecoder')))\n"
        "sys.meta_path.insert(0, h); import json, csv\n"
        "print(seen, 'json.decoder' in h.after, csv.__name__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVDIAG_TRUTH_FILE"}
    out = subprocess.run([sys.executable, "-c", code, str(SITE)], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "[('json.decoder', True)] False csv", out.stderr


def test_the_tail_reads_what_was_appended_since_the_story_began(tmp_path: Path) -> None:
    """An Overload asks the truth file every few seconds: only new lines are read, a line still
    being written waits, and the share limited by KV or a cap is of the recent steps' time."""
    f = _write(tmp_path / "t.jsonl", [[T0 - 50, 1, "", 0, 4, 9, 0.99]])  # an earlier story's
    tail = Tail(f)
    assert tail.limited("kv", 10.0) == 0.0
    with f.open("a") as fh:
        fh.write("".join(json.dumps([T0 + k * 0.5, int(k >= 10), "" if k >= 10 else "seqs", 0, 2, 3, 0.5]) + "\n" for k in range(20)))
        fh.write('[1800000010.0, 1, "", ')
    steps = tail.recent(10.0, now=T0 + 10)
    assert len(steps) == 20  # the last step stands for MAX_STEP_S: 5.5 s on KV, 5 s on the cap
    assert steps.share("kv") == pytest.approx(5.5 / 10.5) and steps.share("seqs") == pytest.approx(5 / 10.5)
    assert tail.recent(5.0, now=T0 + 10).share("kv") == 1.0
    with f.open("a") as fh:
        fh.write('0, 3, 1, 0.9]\n')
    assert len(tail.recent(10.0, now=T0 + 11)) == 19  # the finished line read, T0 + 0.5 s gone
    with f.open("a") as fh:
        fh.write("not json\n")
    with pytest.raises(TruthError, match=r"t.jsonl:23: not a truth line"):
        tail.recent(10.0, now=T0 + 11)


def test_an_overload_raises_its_rate_until_the_engine_is_limited_then_holds() -> None:
    """The load follows what the engine's scheduler decided (``limited``'s answers) and what it
    served, not the clock: the rate goes up by ``factor`` at most ``raises`` times while
    admission is not limited, once more when it is, and to ``over_service`` x the engine's
    service rate; the
    overload lasts ``hold`` from the check that found admission limited, and the drain ends
    ``settle`` after admission stopped being limited."""
    check = 1 / 64
    load = Overload(ClosedLoop(0, 2 * check), 1e-9, hold=4 * check, drain=50 * check, settle=2 * check, by="seqs",
                    patience=2.5 * check, factor=2.0, raises=2, over_service=3.0, longest=100 * check, check=check,
                    lookback=2 * check)  # fmt: skip
    asked: list[tuple[str, float]] = []

    def limited(by: str, seconds: float) -> float:
        """Not limited for 8 checks, then for 6 (4 of the hold, 2 of the drain), then no more."""
        asked.append((by, seconds))
        return 1.0 if 9 <= sum(s == load.lookback for _, s in asked) <= 14 else 0.0

    driver = Driver("http://127.0.0.1:9", Requests())
    served = iter([1e-9] + [1e-8] * 10)  # what the engine finished per second, at each limited check
    driver.served = lambda seconds: next(served)  # type: ignore[method-assign]
    length = driver.run(load, limited)
    # two raises, no more; found limited: x factor (above 3 x served), then 3 x served up to factor x that
    assert [r for _, r in driver.rates] == pytest.approx([1e-9, 2e-9, 4e-9, 8e-9, 1.6e-8, 0.0], rel=1e-9)
    assert [t for t, _ in driver.rates][:3] == pytest.approx([2 * check, (2 + 3) * check, (2 + 6) * check])
    assert driver.limited_at == pytest.approx((2 + 9) * check)
    assert length == pytest.approx((2 + 9 + 4 + 1 + 1 + 2) * check)  # drain: still limited once, free at the next, +settle
    assert {by for by, _ in asked} == {"seqs"} and not driver.records
    with pytest.raises(ValueError, match="needs what limited its admission"):
        driver.run(load)


def test_an_overload_that_never_limits_the_engine_ends_at_its_bound() -> None:
    check = 1 / 64
    load = Overload(ClosedLoop(0, check), 1e-9, hold=1.0, patience=1.5 * check, raises=1, longest=6 * check, check=check)
    driver = Driver("http://127.0.0.1:9", Requests())
    assert driver.run(load, lambda by, s: 0.0) == pytest.approx(7 * check)
    assert driver.limited_at is None and [r for _, r in driver.rates] == pytest.approx([1e-9, 1.5e-9, 0.0], abs=1e-15)


class _Silent(BaseHTTPRequestHandler):
    """A server that takes each request and never sends its first token (an engine whose queue
    does not move) until the client closes the stream; its responses end when it closes."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.flush()
        self.rfile.read(1)  # returns when the client shuts the connection down

    def log_message(self, *args: object) -> None:
        pass


def test_stop_ends_the_streams_still_waiting_for_a_first_token() -> None:
    """``stop`` closes the streams of requests still queued (no chunk yet, the reader blocked
    in recv) and joins their clients, also where the server ends its responses by closing the
    connection (no length, not chunked: the connection gives its socket up to the response)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = Driver(f"http://127.0.0.1:{server.server_address[1]}", Requests(prompt=(10, 20), output=(1, 2)))
    try:
        threading.Thread(target=driver.run, args=(ClosedLoop(3, 3600.0),), daemon=True).start()
        deadline = time.monotonic() + hang_guard(30)
        while len(driver._open) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(driver._open) == 3 and len(driver.records) == 3
        driver.stop(wait=hang_guard(30))
        assert not any(t.is_alive() for t in driver._threads)
        assert [r.error for r in driver.records] == ["stopped"] * 3
    finally:
        server.shutdown()


def test_served_counts_requests_answered_to_their_end() -> None:
    driver = Driver("http://127.0.0.1:9", Requests())
    now = time.time()
    driver.records += [Record(now - 30, 10, 5, now - 29, now - 20, 5), Record(now - 9, 10, 5, now - 8, now - 2, 5),
                       Record(now - 9, 10, 5, now - 8, now - 1, 5), Record(now - 9, 10, 5, None, now - 1, 0, "HTTPError: 500"),
                       Record(now - 5, 10, 5)]  # fmt: skip
    assert driver.served(10.0) == pytest.approx(0.2)


def test_a_queue_draining_behind_kv_refusals_is_a_backlog_while_it_stands(tmp_path: Path) -> None:
    """A real SGLang after an open loop's arrivals stop: 100 waiting drain to 70 in 30 s, every
    step refusing the head for KV, nothing retracted. The queue never fell below the floor: the
    pool limits (an L1 label), not "near capacity". Once it falls below the floor and keeps
    draining, it is no backlog."""
    from kvdiag.refpool.validate import TruthReader

    rows = [[T0 + k * 0.1, 1, "", 0, 3, 100 - k // 10, 0.6] for k in range(300)]
    steps = read(_write(tmp_path / "t.jsonl", rows), T0, T0 + 30)
    span = TruthReader.of(steps.columns, [(1.0, 700)], 2048).span(0, 30)
    assert span.backlog and span.label == "l1_kv_pressure"
    rows = [[T0 + k * 0.1, 1, "", 0, 3, max(0, 20 - k // 10), 0.6] for k in range(300)]  # 20 -> 0
    steps = read(_write(tmp_path / "u.jsonl", rows), T0, T0 + 30)
    span = TruthReader.of(steps.columns, [(1.0, 700)], 2048).span(0, 30)
    assert not span.backlog and span.label == "near_kv_capacity"
