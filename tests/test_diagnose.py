"""`kvdiag diagnose`: sources, the --json shape, exit codes, the terminal report."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvdiag import cli
from kvdiag.refpool.emit import content_type
from kvdiag.sources.recording import write_recording
from tests.checks.scenario import const, ramp, recording
from tests.conftest import Responder, shared_fixture

BOTTLENECK = dict(usage=const(0.97), waiting=ramp(5, 1), running=const(48), evictions=const(1), ttft=const(20.0))


def rec(tmp_path: Path, name: str, engine: str = "sglang", **kw) -> str:
    path = tmp_path / f"{name}.jsonl.gz"
    write_recording(path, recording(engine, **kw))
    return str(path)


def diagnose_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = cli.main(["diagnose", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_json_shape_and_exit_code_for_a_bottleneck(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = diagnose_json(capsys, "--replay", rec(tmp_path, "b", **BOTTLENECK))
    assert code == 2 and out["exit_code"] == 2
    (inst,) = out["instances"]
    assert {"instance", "engine", "verdict", "findings", "checks", "remedies"} <= set(inst)
    assert (inst["engine"], inst["verdict"], inst["findings"]) == ("sglang", "l1_kv_bottleneck", ["concurrency_not_cache"])
    assert isinstance(inst["instance"], str) and all(isinstance(r, str) for r in inst["remedies"])
    assert set(inst["checks"]) == {"kv_usage_saturated", "queue_growing", "evictions_growing", "ttft_p99_high", "prefix_hit_high", "l2_underused"}
    for check in inst["checks"].values():
        assert check["status"] in ("firing", "ok", "unknown") and isinstance(check["evidence"], dict)
    ev = inst["checks"]["evictions_growing"]["evidence"]
    # 59 over the 295 s the samples span, extrapolated to the 300 s window as PromQL's increase() does
    assert ev["increase"] == 60 and ev["span"]["seconds"] == 295 and ev["span"]["samples"] == 60
    assert inst["checks"]["l2_underused"]["missing"] == ["l2_capacity_tokens", "l2_hit_tokens_total"]
    assert inst["figures"]["ceiling"] == 179 and inst["window"]["samples"] == 60


@pytest.mark.parametrize(
    ("kw", "code", "verdict"),
    [
        ({}, 0, "healthy"),
        (dict(usage=const(0.97)), 0, "near_kv_capacity"),
        (dict(usage=const(0.97), waiting=ramp(1, 1)), 1, "l1_kv_pressure"),
        (dict(waiting=ramp(1, 1)), 1, "queue_without_kv_pressure"),
        (BOTTLENECK, 2, "l1_kv_bottleneck"),
        # no retraction counter (E unknown) on a pinned pool: near capacity at least, whatever E is
        (dict(dialect="0.5.3", usage=const(0.97)), 0, "near_kv_capacity"),
    ],
)
def test_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str], kw: dict, code: int, verdict: str) -> None:
    got, out = diagnose_json(capsys, "--replay", rec(tmp_path, "r", "sglang", **kw))
    assert (got, out["instances"][0]["verdict"]) == (code, verdict)


def test_worst_over_instances(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    healthy = tmp_path / "h.jsonl.gz"
    scrapes = recording("vllm")
    for s in scrapes:
        s.target = "http://10.9.9.9:8000"
    write_recording(healthy, scrapes)
    code, out = diagnose_json(capsys, "--replay", str(healthy), "--replay", rec(tmp_path, "p", usage=const(0.97), waiting=ramp(1, 1)))
    assert code == 1 and sorted(i["verdict"] for i in out["instances"]) == ["healthy", "l1_kv_pressure"]


def test_window_and_slo_flags_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = rec(tmp_path, "t", ttft=const(3.0))
    _, out = diagnose_json(capsys, "--replay", path)
    assert out["instances"][0]["checks"]["ttft_p99_high"]["status"] == "ok"
    _, out = diagnose_json(capsys, "--replay", path, "--ttft-slo", "2s", "--window", "1m")
    inst = out["instances"][0]
    assert inst["checks"]["ttft_p99_high"]["status"] == "firing" and inst["window"]["samples"] == 13
    assert "p99_high_without_kv_pressure" in inst["findings"]


def test_single_exposition_file(capsys: pytest.CaptureFixture[str]) -> None:
    path = shared_fixture("sglang-0.5.23-midload.prom")
    code, out = diagnose_json(capsys, str(path))
    (inst,) = out["instances"]
    # one exposition cannot say whether the queue grows or requests are evicted, but the pool is
    # pinned: every reading of the unknown signals names the pool, so the least of them
    assert code == 0 and inst["verdict"] == "near_kv_capacity" and "unknown" in inst["reason"]
    checks = inst["checks"]
    assert checks["kv_usage_saturated"]["status"] == "firing" and checks["ttft_p99_high"]["status"] == "firing"
    assert checks["queue_growing"]["status"] == "unknown" and "needs a window" in checks["queue_growing"]["evidence"]["summary"]
    assert "concurrency_not_cache" in inst["findings"]


def test_not_an_engine_is_unknown_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "node.prom"
    f.write_text("# TYPE node_load1 gauge\nnode_load1 0.5\n")
    code, out = diagnose_json(capsys, str(f))
    (inst,) = out["instances"]
    assert code == 3 and inst["verdict"] == "unknown" and inst["engine"] == "unknown"
    assert "--enable-metrics" in inst["reason"] and "--disable-log-stats" in inst["reason"]
    assert all(c["status"] == "unknown" for c in inst["checks"].values())


def test_sampling_engine_urls(http_server, capsys: pytest.CaptureFixture[str]) -> None:
    """An engine on loopback whose queue grows between scrapes."""
    bodies = itertools.cycle([s.body for s in recording("vllm", steps=40, **BOTTLENECK)])
    url = http_server(Responder(lambda path, headers: (200, {"Content-Type": content_type(False)}, next(bodies).encode())))
    code, out = diagnose_json(capsys, url, "--interval", "0.1", "--duration", "0.8", "--no-progress")
    (inst,) = out["instances"]  # 9 samples: the queue rises by 8, past queue_min_growth (5)
    assert inst["engine"] == "vllm" and inst["window"]["samples"] == 9
    assert inst["checks"]["queue_growing"]["status"] == "firing" and inst["checks"]["evictions_growing"]["status"] == "firing"
    assert code == 2


def test_unreachable_url_is_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = diagnose_json(capsys, "http://127.0.0.1:9/metrics", "--duration", "0", "--timeout", "1")
    assert code == 3 and "127.0.0.1:9" in out["instances"][0]["reason"]


def test_terminal_report(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "220")
    assert cli.main(["diagnose", "--replay", rec(tmp_path, "b", "vllm", **BOTTLENECK)]) == 2
    out = capsys.readouterr().out
    for needle in ("l1_kv_bottleneck", "evictions_growing", "60 evictions", "--max-num-seqs 47", "concurrency_not_cache", "60 samples"):
        assert needle in out


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["diagnose"]) == 3
    assert "give engine URLs" in capsys.readouterr().err
    assert cli.main(["diagnose", "--replay", rec(tmp_path, "x"), "--set", "window=never"]) == 3
    assert "checks.window" in capsys.readouterr().err


def test_a_url_that_never_answers_is_given_up_on_at_once_and_said_once(http_server, capsys: pytest.CaptureFixture[str]) -> None:
    """Two failed first scrapes end sampling (not --duration), with one line per URL."""
    down = Responder(lambda path, headers: (503, {}, b"starting"))
    url = http_server(down)
    code = cli.main(["diagnose", "--json", url, "http://127.0.0.1:9", "--interval", "0.05", "--duration", "600", "--timeout", "2"])
    captured = capsys.readouterr()
    out, err = json.loads(captured.out), captured.err
    assert code == 3 and len(down.requests) == 2  # 12,001 rounds were due: two were made
    assert err.count("giving up on") == 2 and err.count("connection refused") == 1 and len(err.splitlines()) == 2
    assert sorted(i["verdict"] for i in out["instances"]) == ["unknown", "unknown"]
    assert any("connection refused" in i["reason"] for i in out["instances"])


def test_record_to_an_unwritable_path_is_a_clear_error(http_server, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["record", "http://127.0.0.1:9", "--out", "/nonexistent/x.jsonl.gz", "--duration", "0"]) == 3
    err = capsys.readouterr().err
    assert "cannot write /nonexistent/x.jsonl.gz" in err and "Traceback" not in err
    assert cli.main(["record", "http://127.0.0.1:9", "--out", "x.jsonl.gz", "--interval", "nan"]) == 3
    assert "'nan' is not a duration" in capsys.readouterr().err


def test_credentials_in_a_url_never_reach_the_output(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["diagnose", "--json", "http://scraper:hunter2@127.0.0.1:9", "--interval", "0.05", "--duration", "1", "--timeout", "1"])
    captured = capsys.readouterr()
    assert code == 3 and "hunter2" not in captured.out + captured.err
    assert json.loads(captured.out)["instances"][0]["instance"] == "http://127.0.0.1:9"


def test_one_target_that_breaks_the_reader_is_its_own_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import kvdiag.commands.diagnose as diagnose_module

    good, bad = rec(tmp_path, "good", **BOTTLENECK), tmp_path / "bad.prom"
    bad.write_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")
    real = diagnose_module.normalize_scrape

    def broken(s, engine="auto"):  # type: ignore[no-untyped-def]
        if s.target.endswith("bad.prom"):
            raise ArithmeticError("a reader bug")
        return real(s, engine)

    monkeypatch.setattr(diagnose_module, "normalize_scrape", broken)
    code, out = diagnose_json(capsys, "--replay", good, str(bad))
    verdicts = {i["instance"].rsplit("/", 1)[-1]: (i["verdict"], i["reason"]) for i in out["instances"]}
    assert code in (2, 3) and verdicts["bad.prom"][0] == "unknown" and "internal error reading this target: ArithmeticError" in verdicts["bad.prom"][1]
    assert any(v == "l1_kv_bottleneck" for v, _ in verdicts.values())


def test_a_down_target_says_its_reason_once(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["diagnose", "http://127.0.0.1:9", "--interval", "0.05", "--timeout", "1"]) == 3
    captured = capsys.readouterr()
    assert captured.out.count("connection refused") == 1 and captured.err.count("connection refused") == 1


def test_the_progress_bar_counts_failed_scrapes(http_server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import kvdiag.commands.diagnose as diagnose_module

    descriptions: list[str] = []

    class Watched(diagnose_module.Progress):  # the real bar, its last words kept
        def __exit__(self, *exc: object) -> None:
            descriptions.extend(t.description for t in self.tasks)
            super().__exit__(*exc)  # type: ignore[arg-type]

    monkeypatch.setattr(diagnose_module, "Progress", Watched)
    bodies = itertools.cycle([s.body for s in recording("vllm", steps=40, **BOTTLENECK)])
    url = http_server(Responder(lambda path, headers: (200, {"Content-Type": content_type(False)}, next(bodies).encode())))
    cli.main(["diagnose", url, "http://127.0.0.1:9", "--interval", "0.05", "--duration", "0.2"])
    assert descriptions == ["sampling 2 engine(s) every 0.05s · 2 failed scrape(s)"]
