"""Server logs as a source: every line format of both engines, collector prefixes, ranks,
timestamps, garbage and truncated lines, --follow, stdin, and a saturation story told in log
lines. ``saturation_story`` is public: the diagnose tests feed the same story to the checks."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pytest

from kvdiag.checks.stats import deriv
from kvdiag.cli import main
from kvdiag.model import PoolSample
from kvdiag.sources.logs import LogStream, read_log

UNSEEN = "evictions_total absent: "  # the note of a vLLM log that cannot carry preemptions


def unseen(s: PoolSample) -> bool:
    return any(n.startswith(UNSEEN) for n in s.notes)
from kvdiag.window import windows
from tests.conftest import hang_guard

T0 = datetime(2026, 11, 29, 11, 33, 15, tzinfo=timezone.utc)
TS0 = T0.timestamp()


def sglang(message: str, ranks: str = "", at: datetime = T0, ms: bool = False) -> str:
    """One SGLang log line: ``[%Y-%m-%d %H:%M:%S(.mmm)( ranks)] message``."""
    stamp = at.strftime("%Y-%m-%d %H:%M:%S") + (f".{at.microsecond // 1000:03d}" if ms else "")
    return f"[{stamp}{' ' + ranks if ranks else ''}] {message}"


def vllm(message: str, at: datetime = T0, proc: str | None = "APIServer pid=12", level: str = "INFO",
         src: str = "[loggers.py:248]") -> str:
    """One vLLM log line: ``(Proc pid=N) LEVEL MM-DD HH:MM:SS [file:line] message``."""
    head = f"({proc}) " if proc else ""
    return f"{head}{level} {at.strftime('%m-%d %H:%M:%S')} {src} {message}"


def v1_stats(running: int, waiting: int, usage_pct: float, *, engine: str | None = "Engine 000: ",
             extra_mid: str = "", preemptions: int | None = None, hit: float | None = 45.0, tail: str = "",
             device: str = "GPU") -> str:
    pre = f"Preemptions: {preemptions}, " if preemptions is not None else ""
    hit_part = f", Prefix cache hit rate: {hit:.1f}%" if hit is not None else ""
    return (
        f"{engine or ''}Avg prompt throughput: 1024.5 tokens/s, Avg generation throughput: 2048.3 tokens/s, "
        f"Running: {running} reqs, Waiting: {waiting} reqs, {extra_mid}{pre}{device} KV cache usage: "
        f"{usage_pct:.1f}%{hit_part}{tail}"
    )


def sg_decode(running: int, tokens: int, usage: float, queue: int, *, trailing: bool = False, head: str = "Decode batch,") -> str:
    return (
        f"{head} #running-req: {running}, #token: {tokens}, token usage: {usage:.2f}, cuda graph: True, "
        f"gen throughput (token/s): 1389.42, #queue-req: {queue}" + (", " if trailing else "")
    )


def sg_prefill(new: int, cached: int, usage: float, running: int, queue: int) -> str:
    return (
        f"Prefill batch, #new-seq: 1, #new-token: {new}, #cached-token: {cached}, token usage: {usage:.2f}, "
        f"#running-req: {running}, #queue-req: {queue}, #pending-token: 0, cuda graph: False, "
        "input throughput (token/s): 10234.55"
    )


def sg_retract(n: int, old: float = 0.3, new: float = 0.5) -> str:
    return (f"KV cache pool is full. Retract requests. #retracted_reqs: {n}, #new_tokens_gained: 646, "
            f"#new_token_ratio: {old:.4f} -> {new:.4f}")


def read(lines: Iterable[str], name: str = "app.log", **kw) -> tuple[list[PoolSample], LogStream]:
    stream = read_log(io.StringIO("".join(line + "\n" for line in lines)), name=name, **kw)
    return list(stream), stream


def one(line: str, **kw) -> PoolSample:
    samples, stream = read([line], **kw)
    assert stream.report.unparsed == 0, stream.report.problems
    assert len(samples) == 1, f"expected one sample from {line!r}"
    return samples[0]


# --- the saturation story, told in log lines ---------------------------------------------------


@dataclass
class Story:
    """A log in which the pool fills, pins at 1 and the queue and evictions grow.

    ``saturated_from`` is when the pool pins; ``evictions`` the retracted / preempted requests
    the story logs from then on (none before). Read it with ``read_log(path, year=story.year)``.
    """

    engine: str
    lines: list[str]
    start: float
    saturated_from: float
    end: float  # one interval after the last line
    evictions: int
    year: int = 2026
    instance_suffix: str = ""

    def write(self, path: Path) -> Path:
        path.write_text("".join(line + "\n" for line in self.lines))
        return path


def saturation_story(engine: str = "sglang", *, healthy_s: int = 180, saturated_s: int = 420, tp: int = 1,
                     start: datetime = datetime(2026, 11, 29, 11, 0, tzinfo=timezone.utc)) -> Story:
    """SGLang: Decode and Prefill lines every 4 s, access-log noise, and (once saturated) a retract
    warning every 12 s, printed by every TP rank while only TP0 prints stats. vLLM: one line every
    10 s, ``Preemptions: N`` in saturated intervals only, a high prefix hit rate throughout: a build
    that prints the field, which no release up to 0.33.0 does (``test_logs_oracle`` reads the
    engine's own lines); ``evictions`` counts from the first line that prints it."""
    lines: list[str] = []
    evictions = 0
    sat = start + timedelta(seconds=healthy_s)
    end = sat + timedelta(seconds=saturated_s)
    if engine == "sglang":
        step, waiting = 4, 0
        t = start
        k = 0
        while t <= end:
            saturated = t >= sat
            frac = (t - start).total_seconds() / healthy_s
            usage = 0.98 + 0.02 * (k % 2) if saturated else 0.40 + 0.45 * frac
            waiting = waiting + 2 if saturated else 0
            running = 60 if saturated else int(10 + 40 * frac)
            ranks = "TP0" if tp > 1 else ""
            lines.append(sglang(sg_decode(running, int(usage * 200000), usage, waiting), ranks, t))
            lines.append(sglang('INFO:     10.0.0.7:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK', ranks, t))
            lines.append(sglang(sg_prefill(512, 3584, usage, running, waiting), ranks, t + timedelta(seconds=2)))
            if saturated and k % 3 == 0:
                n = 1 + (k // 3) % 3
                evictions += n
                for rank in range(tp):
                    lines.append(sglang(sg_retract(n), f"TP{rank}" if tp > 1 else "", t + timedelta(seconds=3)))
            t += timedelta(seconds=step)
            k += 1
        return Story(engine, lines, start.timestamp(), sat.timestamp(), (end + timedelta(seconds=step)).timestamp(),
                     evictions)
    t, k, waiting, printed = start, 0, 0, False
    while t <= end:
        saturated = t >= sat
        frac = (t - start).total_seconds() / healthy_s
        usage = 99.0 + (k % 3) * 0.5 if saturated else 30.0 + 40.0 * frac
        waiting = waiting + 3 if saturated else 0
        pre = 1 + k % 3 if saturated else None
        evictions += (pre or 0) if printed else 0  # the count rises from the first line that prints it
        printed = printed or pre is not None
        lines.append(vllm(v1_stats(64 if saturated else 20, waiting, usage, preemptions=pre, hit=85.0), t))
        lines.append(vllm('10.0.0.7:51234 - "POST /v1/completions HTTP/1.1" 200 OK', t, src="[launcher.py:99]"))
        t += timedelta(seconds=10)
        k += 1
    return Story(engine, lines, start.timestamp(), sat.timestamp(), (end + timedelta(seconds=10)).timestamp(),
                 evictions, instance_suffix=" engine=0")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_saturation_story_yields_pinned_usage_growing_queue_and_evictions(engine: str, tmp_path: Path) -> None:
    story = saturation_story(engine)
    path = story.write(tmp_path / f"{engine}.log")
    stream = read_log(path, year=story.year)
    wins = windows(stream)
    assert list(wins) == [f"{path}{story.instance_suffix}"]
    w = wins[f"{path}{story.instance_suffix}"]
    assert stream.report.unparsed == 0
    sat = story.saturated_from
    ts, usage = w.points("usage_ratio", since=sat)
    assert usage.min() >= 0.98 and len(usage) >= 40  # pinned, over many samples
    assert w.points("usage_ratio")[1][0] < 0.5  # it was not pinned from the start
    assert deriv(*w.points("waiting", since=sat)) > 0
    assert deriv(*w.points("waiting", since=story.start)) > 0
    assert w.increase("evictions_total") == story.evictions > 0
    assert w.increase("evictions_total", since=sat) > 0
    ev_ts, ev = w.points("evictions_total")
    if engine == "sglang":
        assert ev[ev_ts < sat].max() == 0  # none while healthy
    else:  # unseen (absent, not 0) until the first line that prints 'Preemptions'
        assert ev_ts[0] >= sat and w.points("usage_ratio")[0][0] < sat
    assert (np.diff(ev) >= 0).all()  # a running sum never goes down
    assert w.end <= story.end and w.start == story.start


def test_story_across_tensor_parallel_ranks_counts_each_retraction_once(tmp_path: Path) -> None:
    one_rank = saturation_story("sglang")
    four = saturation_story("sglang", tp=4)
    assert sum("Retract" in line for line in four.lines) == 4 * sum("Retract" in line for line in one_rank.lines)
    stream = read_log(four.write(tmp_path / "tp4.log"))
    (w,) = windows(stream).values()
    assert w.instance == str(tmp_path / "tp4.log")  # TP ranks are one pool: no tp_rank in the key
    assert w.increase("evictions_total") == four.evictions == one_rank.evictions
    assert stream.report.duplicate_rank_lines == 3 * sum("Retract" in line for line in one_rank.lines)


# --- SGLang formats ----------------------------------------------------------------------------

DECODE_VARIANTS = {
    "0.4.3 (largest-len, trailing comma)": "Decode batch. #running-req: 12, #token: 3000, token usage: 0.45, "
    "gen throughput (token/s): 512.30, largest-len: 900, #queue-req: 3, ",
    "0.4.6 (cuda graph, no trailing comma)": "Decode batch. #running-req: 12, #token: 3000, token usage: 0.45, "
    "cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 3",
    "0.4.10-0.5.3 (trailing comma)": "Decode batch. #running-req: 12, #token: 3000, token usage: 0.45, "
    "cuda graph: False, gen throughput (token/s): 512.30, #queue-req: 3, ",
    "0.5.4 [iter]": "Decode batch [81920], #running-req: 12, #token: 3000, token usage: 0.45, cuda graph: True, "
    "gen throughput (token/s): 512.30, #queue-req: 3, ",
    "0.5.5-0.5.8 (comma, trailing comma)": "Decode batch, #running-req: 12, #token: 3000, token usage: 0.45, "
    "cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 3, ",
    "trailing comma with the space stripped": "Decode batch, #running-req: 12, #token: 3000, token usage: 0.45, "
    "cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 3,",
    "0.5.9+ (no trailing comma)": "Decode batch, #running-req: 12, #token: 3000, token usage: 0.45, "
    "cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 3",
    "[iter] on 0.5.23": "Decode batch [7], #running-req: 12, #token: 3000, token usage: 0.45, cuda graph: True, "
    "gen throughput (token/s): 512.30, #queue-req: 3",
    "spec decode (accept len, accept rate)": "Decode batch, #running-req: 12, #token: 3000, token usage: 0.45, "
    "accept len: 2.85, accept rate: 0.62, cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 3",
    "spec decode 0.4.x (accept len only)": "Decode batch. #running-req: 12, #token: 3000, token usage: 0.45, "
    "accept len: 2.85, cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 3, ",
    "cpu graph": "Decode batch, #running-req: 12, #token: 3000, token usage: 0.45, cpu graph: False, "
    "gen throughput (token/s): 512.30, #queue-req: 3",
    "npu graph": "Decode batch, #running-req: 12, #token: 3000, token usage: 0.45, npu graph: True, "
    "gen throughput (token/s): 512.30, #queue-req: 3",
    "musa graph": "Decode batch, #running-req: 12, #token: 3000, token usage: 0.45, musa graph: True, "
    "gen throughput (token/s): 512.30, #queue-req: 3",
    "#cached-token and trailing MFU / occupancy fields": "Decode batch, #running-req: 12, #cached-token: 0, "
    "#token: 3000, token usage: 0.45, cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 3, "
    "est. decode TFLOPS/s (per GPU): 12.50, est. read BW (GB/s per GPU): 1800.00, "
    "est. write BW (GB/s per GPU): 3.20, fwd occupancy: 91.20%",
    "PD decode server fields": "Decode batch, #running-req: 12, #token: 3000, token usage: 0.45, "
    "pre-allocated usage: 0.10, #prealloc-req: 2, #transfer-req: 1, #retracted-req: 0, cuda graph: True, "
    "gen throughput (token/s): 512.30, #queue-req: 3",
}


@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_sglang_decode_variants(variant: str) -> None:
    s = one(sglang(DECODE_VARIANTS[variant]))
    assert (s.engine, s.instance, s.ts) == ("sglang", "app.log", TS0)
    assert (s.running, s.waiting, s.usage_ratio, s.used_tokens) == (12, 3, 0.45, 3000)
    assert s.usage_granularity == "token"
    assert s.provenance["usage_ratio"].metric == "app.log:1"
    assert "'token usage'" in s.provenance["usage_ratio"].note
    assert s.evictions_total == 0 and s.provenance["evictions_total"].derived
    # Nothing the line does not carry is invented.
    for absent in ("capacity_tokens", "evictable_tokens", "available_tokens", "prefix_hit_ratio_gauge",
                   "prefix_hit_tokens_total", "decode_reserve_ratio", "ttft", "queue_time"):
        assert getattr(s, absent) is None, absent


@pytest.mark.parametrize(
    ("pool", "usage", "used", "derived"),
    [
        ("#full token: 3000, full token usage: 0.45, #swa token: 800, swa token usage: 0.91", 0.91, 3000, True),
        ("#full token: 3000, full token usage: 0.45, mamba num: 30, mamba usage: 0.60", 0.60, 3000, True),
        ("#full token: 3000, full token usage: 0.95, #swa token: 800, swa token usage: 0.51, "
         "mamba num: 30, mamba usage: 0.60", 0.95, 3000, True),
    ],
    ids=["hybrid SWA", "mamba", "SWA + mamba"],
)
def test_sglang_hybrid_pools_report_the_fullest_pool(pool: str, usage: float, used: int, derived: bool) -> None:
    line = f"Decode batch, #running-req: 12, {pool}, cuda graph: True, gen throughput (token/s): 512.30, #queue-req: 3"
    s = one(sglang(line))
    assert (s.usage_ratio, s.used_tokens, s.running, s.waiting) == (usage, used, 12, 3)
    assert s.provenance["usage_ratio"].derived is derived and "max of" in s.provenance["usage_ratio"].note
    assert s.provenance["used_tokens"].note.startswith("SGLang 'Decode batch' line, field '#full token'")


PREFILL_VARIANTS = {
    "0.4.x-0.5.3 (period, trailing comma)": "Prefill batch. #new-seq: 2, #new-token: 800, #cached-token: 3200, "
    "token usage: 0.45, #running-req: 10, #queue-req: 3, ",
    "0.5.9-0.5.10 (no #pending-token)": "Prefill batch, #new-seq: 2, #new-token: 800, #cached-token: 3200, "
    "token usage: 0.45, #running-req: 10, #queue-req: 3, cuda graph: False, input throughput (token/s): 10234.55",
    "0.5.23 (#pending-token)": "Prefill batch, #new-seq: 2, #new-token: 800, #cached-token: 3200, "
    "token usage: 0.45, #running-req: 10, #queue-req: 3, #pending-token: 0, cuda graph: False, "
    "input throughput (token/s): 10234.55",
    "#replay-token and PD prefill fields": "Prefill batch, #new-seq: 2, #new-token: 800, #cached-token: 3200, "
    "token usage: 0.45, #running-req: 10, #queue-req: 3, #pending-token: 128, #replay-token: 12, "
    "#bootstrap-req: 1, #inflight-req: 2, cuda graph: False, input throughput (token/s): 10234.55",
    "[iter] with MFU and occupancy": "Prefill batch [77], #new-seq: 2, #new-token: 800, #cached-token: 3200, "
    "token usage: 0.45, #running-req: 10, #queue-req: 3, #pending-token: 0, cuda graph: False, "
    "input throughput (token/s): 10234.55, est. prefill TFLOPS/s (per GPU): 310.00, fwd occupancy: 88.00%",
    "hybrid SWA usage parts": "Prefill batch, #new-seq: 2, #new-token: 800, #cached-token: 3200, "
    "full token usage: 0.30, swa token usage: 0.45, #running-req: 10, #queue-req: 3, #pending-token: 0, "
    "cuda graph: False, input throughput (token/s): 10234.55",
}


@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
def test_sglang_prefill_variants(variant: str) -> None:
    s = one(sglang(PREFILL_VARIANTS[variant]))
    assert (s.running, s.waiting, s.usage_ratio) == (10, 3, 0.45)
    assert s.used_tokens is None  # the prefill line has no token count
    assert (s.prefix_hit_tokens_total, s.prefix_query_tokens_total) == (3200, 4000)
    assert s.provenance["prefix_query_tokens_total"].derived


@pytest.mark.parametrize(
    ("line", "retracted", "ratio"),
    [
        ("Decode out of memory happened. #retracted_reqs: 3, #new_token_ratio: 0.4000 -> 0.6000", 3, 0.6),
        ("KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_token_ratio: 0.7000 -> 0.8500", 2, 0.85),
        ("KV cache pool is full. Retract requests. #retracted_reqs: 2, #aborted_retracted_reqs: 1, "
         "#new_token_ratio: 0.7000 -> 0.8500", 2, 0.85),
        ("KV cache pool is full. Retract requests. #retracted_reqs: 4, #new_tokens_gained: 646, "
         "#new_token_ratio: 0.0980 -> 0.3487", 4, 0.3487),
        ("KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 646, "
         "#mamba_num_gained: 1, #new_token_ratio: 0.0980 -> 0.3487", 1, 0.3487),
        ("KV cache pool is full. Retract requests. #retracted_reqs: 5", 5, None),
    ],
    ids=["<=0.4.6 decode out of memory", "0.4.10-0.5.6", "0.5.4 aborted", "0.5.23", "0.5.23 mamba", "no ratio"],
)
def test_sglang_retract_variants_sum_into_evictions(line: str, retracted: int, ratio: float | None) -> None:
    later = T0 + timedelta(seconds=4)
    samples, stream = read([sglang(sg_decode(10, 100, 0.99, 5)), sglang(line, at=T0 + timedelta(seconds=1)),
                            sglang(line, at=T0 + timedelta(seconds=2)), sglang(sg_decode(9, 100, 0.99, 6), at=later),
                            sglang(sg_decode(9, 100, 0.99, 6), at=later + timedelta(seconds=4))])
    assert stream.report.unparsed == 0 and stream.report.engine_lines == 5
    assert [s.evictions_total for s in samples] == [0, 2 * retracted, 2 * retracted]
    prov = samples[1].provenance["evictions_total"]
    assert prov.metric == "app.log:3" and prov.derived and "over 2 retract warning(s)" in prov.note
    assert samples[1].decode_reserve_ratio == ratio
    assert samples[2].decode_reserve_ratio is None  # the engine decays it: not carried forward
    if ratio is not None:
        assert samples[1].provenance["decode_reserve_ratio"].metric == "app.log:3"


def test_retractions_after_the_last_stats_line_get_a_final_sample() -> None:
    samples, _ = read([sglang(sg_decode(10, 100, 0.99, 5)), sglang(sg_retract(3), at=T0 + timedelta(seconds=7))])
    assert [(s.ts, s.evictions_total) for s in samples] == [(TS0, 0), (TS0 + 7, 3)]
    last = samples[-1]
    assert last.running == 10 and last.provenance["running"].metric == "app.log:1"
    assert any("last warning after the final stats line" in n for n in last.notes)


@pytest.mark.parametrize(
    ("ranks", "instance"),
    [
        ("", "app.log"),
        ("TP0", "app.log"),
        ("DP1 TP0", "app.log dp_rank=1"),
        ("DP0 PP0 TP0", "app.log dp_rank=0"),
        ("DP3 PP0 ATTN_CP0 MOE_DP0 TP0 EP0", "app.log dp_rank=3"),
        ("TP0 EP0", "app.log"),
    ],
)
def test_sglang_rank_prefixes(ranks: str, instance: str) -> None:
    s = one(sglang(sg_decode(12, 3000, 0.45, 3), ranks))
    assert s.instance == instance
    assert s.labels == ({"dp_rank": instance.split("=")[1]} if "dp_rank" in instance else {})


def test_sglang_pipeline_and_tensor_ranks_repeat_one_pool() -> None:
    samples, stream = read([
        sglang(sg_decode(12, 3000, 0.45, 3), "PP0 TP0"),
        sglang(sg_decode(12, 3000, 0.45, 3), "PP1 TP0"),
        sglang(sg_retract(2), "PP0 TP0"),
        sglang(sg_retract(2), "PP0 TP1"),
        sglang(sg_retract(2), "PP1 TP0"),
        sglang(sg_decode(12, 3000, 0.45, 3), "PP0 TP0", at=T0 + timedelta(seconds=5)),
    ])
    assert [s.evictions_total for s in samples] == [0, 2]
    assert {s.instance for s in samples} == {"app.log"}
    assert stream.report.duplicate_rank_lines == 3


def test_data_parallel_ranks_are_separate_pools() -> None:
    samples, _ = read([
        sglang(sg_decode(12, 3000, 0.45, 3), "DP0 TP0"),
        sglang(sg_decode(40, 9000, 0.99, 20), "DP1 TP0"),
        sglang(sg_retract(4), "DP1 TP1"),
        sglang(sg_retract(4), "DP1 TP0"),
        sglang(sg_decode(41, 9000, 0.99, 22), "DP1 TP0", at=T0 + timedelta(seconds=4)),
        sglang(sg_decode(13, 3000, 0.46, 3), "DP0 TP0", at=T0 + timedelta(seconds=4)),
    ])
    wins = windows(samples)
    assert sorted(wins) == ["app.log dp_rank=0", "app.log dp_rank=1"]
    assert wins["app.log dp_rank=1"].increase("evictions_total") == 4
    assert wins["app.log dp_rank=0"].increase("evictions_total") == 0
    assert list(wins["app.log dp_rank=0"].column("running")) == [12, 13]


def test_dp_attention_tp_leaders_print_their_own_pools() -> None:
    """Under --enable-dp-attention every attention-TP leader is a TP rank that prints stats."""
    samples, stream = read([
        sglang(sg_retract(9), "TP1"),  # before TP1 showed it owns a pool: a duplicate
        sglang(sg_decode(12, 3000, 0.45, 3), "TP0"),
        sglang(sg_decode(30, 9000, 0.97, 8), "TP1"),
        sglang(sg_retract(2), "TP1"),
        sglang(sg_decode(29, 9000, 0.97, 9), "TP1", at=T0 + timedelta(seconds=4)),
    ])
    last = {s.instance: s for s in samples}
    assert sorted(last) == ["app.log", "app.log tp_rank=1"]
    assert last["app.log tp_rank=1"].evictions_total == 2 and last["app.log"].evictions_total == 0
    assert stream.report.duplicate_rank_lines == 1


def test_sglang_log_ms_timestamps() -> None:
    at = T0 + timedelta(milliseconds=250)
    s = one(sglang(sg_decode(1, 10, 0.01, 0), "DP0 TP0", at=at, ms=True))
    assert s.ts == pytest.approx(TS0 + 0.25)


# --- vLLM formats --------------------------------------------------------------------------------


def test_vllm_v1_line_with_every_optional_field() -> None:
    line = v1_stats(48, 35, 97.5, extra_mid="Deferred: 2 reqs, KV fetch: 3 reqs, ", preemptions=4, hit=45.0,
                    tail=", External prefix cache hit rate: 12.0%, MM cache hit rate: 0.0%, Corrupted: 0 reqs")
    s = one(vllm(line))
    assert (s.engine, s.instance, s.labels) == ("vllm", "app.log engine=0", {"engine": "0"})
    assert (s.running, s.waiting, s.usage_ratio, s.evictions_total) == (48, 35, 0.975, 4)
    assert s.usage_granularity == "block"
    assert s.prefix_hit_ratio_gauge == pytest.approx(0.45)
    assert "last 1000 requests" in s.provenance["prefix_hit_ratio_gauge"].note
    assert "Deferred" in s.provenance["waiting"].note
    assert s.provenance["usage_ratio"].note.startswith("vLLM periodic stats line (loggers.py:248), field 'GPU KV")
    assert not unseen(s)
    for absent in ("used_tokens", "capacity_tokens", "prefix_hit_tokens_total", "decode_reserve_ratio", "ttft"):
        assert getattr(s, absent) is None, absent


@pytest.mark.parametrize(
    ("line", "instance", "usage"),
    [
        (vllm(v1_stats(3, 0, 12.5, engine="Engine 001: ")), "app.log engine=1", 0.125),
        (vllm(v1_stats(3, 0, 12.5, device="XPU")), "app.log engine=0", 0.125),
        (vllm(v1_stats(3, 0, 12.5, device="NPU"), proc="EngineCore_DP0 pid=77"), "app.log engine=0", 0.125),
        (vllm(v1_stats(3, 0, 12.5), proc=None), "app.log engine=0", 0.125),
        (vllm(v1_stats(3, 0, 12.5, engine=None), proc=None), "app.log", 0.125),  # 0.8.x: no engine index
        (vllm(v1_stats(3, 0, 12.5, hit=None)), "app.log engine=0", 0.125),
        ("\x1b[32mINFO\x1b[0m \x1b[90m11-29 11:33:15\x1b[0m \x1b[90m[loggers.py:248]\x1b[0m "
         + v1_stats(3, 0, 12.5), "app.log engine=0", 0.125),
        (vllm(v1_stats(3, 0, 12.5)).replace("11:33:15 ", "11:33:15.000 "), "app.log engine=0", 0.125),
    ],
    ids=["engine 1", "XPU", "NPU EngineCore", "no process tag", "0.8 no engine", "no hit rate", "ANSI colour",
         "plugin milliseconds"],
)
def test_vllm_v1_variants(line: str, instance: str, usage: float) -> None:
    s = one(line, year=2026)
    assert (s.instance, s.running, s.waiting, s.usage_ratio, s.ts) == (instance, 3, 0, usage, TS0)
    assert s.evictions_total is None and unseen(s)  # vLLM V1 never prints 'Preemptions': absent, not 0


def test_vllm_preemptions_count_only_once_the_log_shows_the_field() -> None:
    """No release prints the field; a build that does prints it when > 0: from its first
    appearance on, a line without it counts 0 (and the lines before it counted 0 too)."""
    counts = [None, 3, None, 2, None]
    lines = [vllm(v1_stats(10, 5, 99.0, preemptions=c), T0 + timedelta(seconds=10 * i)) for i, c in enumerate(counts)]
    samples, _ = read(lines, year=2026)
    assert [s.evictions_total for s in samples] == [None, 3, 3, 5, 5]
    assert unseen(samples[0]) and not unseen(samples[1])
    assert "app.log:1 to app.log:1 would have carried it" in samples[0].notes[-1]
    assert samples[-1].provenance["evictions_total"].metric == "app.log:5"
    assert "from line 2 on" in samples[-1].provenance["evictions_total"].note


@pytest.mark.parametrize(
    ("version_line", "who"),
    [
        ("Initializing a V1 LLM engine (v0.33.0) with config: model='m', speculative_config=None",
         "vLLM 0.33.0 (app.log:1)"),
        ("vLLM API server version 0.12.0", "vLLM 0.12.0 (app.log:1) prints no 'Preemptions' field"),
        ("vLLM API server version 0.10.1.1", "vLLM 0.10.1.1 (app.log:1) has no 'Preemptions' field"),
        (" \u2584\u2584 \u2584\u2588 \u2588     \u2588     \u2588 \u2580\u2584\u2580 \u2588  version 0.40.1", "vLLM 0.40.1 (app.log:1; newer"),
        (None, "its version is not in the log"),
    ],
    ids=["engine core", "api server", "before the field", "logo, newer", "no version line"],
)
def test_vllm_missing_preemptions_say_which_version_and_how_to_get_them(version_line: str | None, who: str) -> None:
    lines = [vllm(version_line, src="[core.py:140]")] if version_line else []
    lines += [vllm(v1_stats(10, 5, 99.0), T0 + timedelta(seconds=10 * i)) for i in range(3)]
    samples, stream = read(lines, year=2026)
    assert [s.evictions_total for s in samples] == [None] * 3
    note = next(n for n in samples[-1].notes if n.startswith(UNSEEN))
    assert who in note and "vllm:num_preemptions_total" in note and "not 0" in note
    start = 2 if version_line else 1
    assert f"app.log:{start} to app.log:{start + 2} would have carried it" in note
    assert stream.report.engine_lines == 3 and stream.report.unparsed == 0  # the version line is no stats line


def test_vllm_aggregated_engines_line_is_flagged() -> None:
    s = one(vllm(v1_stats(96, 40, 98.0, engine="4 Engines Aggregated: ")), year=2026)
    assert s.instance == "app.log engines_aggregated=4"
    assert any("usage is the mean over engines" in n for n in s.notes)


def test_vllm_v0_lines() -> None:
    v0 = ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 310.2 tokens/s, Running: 5 reqs, "
          "Swapped: 0 reqs, Pending: 7 reqs, GPU KV cache usage: {u}%, CPU KV cache usage: 0.0%.")
    preempt = ("Sequence group 12 is preempted by PreemptionMode.RECOMPUTE mode because there is not enough KV "
               "cache space. This can affect the end-to-end performance. Increase gpu_memory_utilization or "
               "tensor_parallel_size to provide more KV cache memory. total_num_cumulative_preemption=51")
    lines = [
        vllm(v0.format(u="99.2"), proc=None, src="metrics.py:345]"),
        vllm("Prefix cache hit rate: GPU: 63.15%, CPU: 0.00%", proc=None, src="metrics.py:361]"),
        vllm(preempt, T0 + timedelta(seconds=2), proc=None, level="WARNING", src="scheduler.py:1556]"),
        vllm(v0.format(u="99.9"), T0 + timedelta(seconds=5), proc=None, src="metrics.py:345]"),
    ]
    samples, stream = read(lines, year=2026)
    assert stream.report.unparsed == 0
    first, second = samples
    assert (first.instance, first.running, first.waiting, first.usage_ratio) == ("app.log", 5, 7, 0.992)
    assert first.evictions_total is None  # V0 counts only appear with the warning
    assert first.prefix_hit_ratio_gauge is None
    assert second.evictions_total == 51 and not second.provenance["evictions_total"].derived
    assert second.prefix_hit_ratio_gauge == pytest.approx(0.6315)
    assert second.provenance["prefix_hit_ratio_gauge"].metric == "app.log:2"
    assert "'Pending'" in second.provenance["waiting"].note


def test_vllm_lines_that_start_with_engine_but_are_not_stats_are_skipped() -> None:
    samples, stream = read([vllm("Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: 9000"),
                            vllm("SpecDecoding metrics: Mean acceptance length: 2.10, Accepted: 20 tokens")])
    assert samples == [] and stream.report.unparsed == 0 and stream.report.lines == 2


# --- collectors: docker, kubectl, journald, compose ---------------------------------------------


def test_docker_timestamps_win_over_the_engine_stamp() -> None:
    line = "2026-11-29T11:33:15.123456789Z " + sglang(sg_decode(12, 3000, 0.45, 3), at=T0 - timedelta(hours=2))
    s = one(line)
    assert s.ts == pytest.approx(TS0 + 0.123456789) and s.instance == "app.log"
    assert not any("carry no zone" in n for n in s.notes)


def test_kubectl_prefix_and_timestamps() -> None:
    line = "[pod/vllm-0/server] 2026-11-29T12:33:15+01:00 " + vllm(v1_stats(3, 1, 50.0))
    s = one(line)
    assert s.instance == "app.log engine=0 source=pod/vllm-0/server"
    assert s.ts == TS0


def test_kubectl_prefix_without_timestamps() -> None:
    s = one("[pod/sglang-7f9/sglang] " + sglang(sg_decode(12, 3000, 0.45, 3), "DP1 TP0"))
    assert s.instance == "app.log dp_rank=1 source=pod/sglang-7f9/sglang" and s.ts == TS0


def test_journald_short_and_short_iso() -> None:
    short = "Nov 29 11:33:15 gpu-node-3 sglang[4242]: " + sglang(sg_decode(12, 3000, 0.45, 3), "DP1 TP0")
    s = one(short)
    assert (s.instance, s.ts) == ("app.log dp_rank=1 source=gpu-node-3/sglang", TS0)
    iso = "2026-11-29T12:33:15+0100 gpu-node-3 vllm[99]: " + vllm(v1_stats(3, 1, 50.0), T0 + timedelta(hours=5))
    s = one(iso)
    assert (s.instance, s.ts) == ("app.log engine=0 source=gpu-node-3/vllm", TS0)  # the zoned stamp wins


def test_docker_compose_prefix() -> None:
    s = one("sglang-1  | " + sglang(sg_decode(12, 3000, 0.45, 3)))
    assert s.instance == "app.log source=sglang-1"
    s = one("vllm-1  | 2026-11-29T11:33:15.000000000Z " + vllm(v1_stats(3, 1, 50.0)))
    assert (s.instance, s.ts) == ("app.log engine=0 source=vllm-1", TS0)


# --- timestamps -------------------------------------------------------------------------------


def test_vllm_year_rolls_over_at_new_year() -> None:
    a = datetime(2025, 12, 31, 23, 59, 55, tzinfo=timezone.utc)
    b = datetime(2026, 1, 1, 0, 0, 5, tzinfo=timezone.utc)
    samples, stream = read([vllm(v1_stats(1, 0, 1.0), a), vllm(v1_stats(1, 0, 1.0), b)], year=2025)
    assert [s.ts for s in samples] == [a.timestamp(), b.timestamp()]
    assert any("read in 2025 (as given)" in x for x in stream.report.assumptions)
    assert any("read in 2026 (as given)" in x for x in stream.report.assumptions)


def test_vllm_default_year_is_the_current_one_unless_that_is_the_future() -> None:
    now = datetime.now(timezone.utc).replace(microsecond=0)
    past, future = now - timedelta(days=2), now + timedelta(days=5)
    if past.year == now.year:
        (s,) = read([vllm(v1_stats(1, 0, 1.0), past)])[0]
        assert s.ts == past.timestamp()
    if future.year == now.year:  # a stamp ahead of now was written last year
        (s,) = read([vllm(v1_stats(1, 0, 1.0), future)])[0]
        assert s.ts == future.replace(year=now.year - 1).timestamp()


@pytest.mark.parametrize("tz", ["+02:00", "Europe/Paris"])
def test_timestamps_without_a_zone_are_read_in_the_given_one(tz: str) -> None:
    summer = datetime(2026, 7, 1, 12, 0, 0, tzinfo=timezone.utc)
    s = one(sglang(sg_decode(1, 10, 0.01, 0), at=summer), tz=tz)
    assert s.ts == summer.timestamp() - 2 * 3600
    assert any(tz in n for n in s.notes)


def test_an_unknown_zone_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown time zone"):
        read_log(io.StringIO(""), tz="Mars/Olympus")


# --- garbage, truncation, streaming ---------------------------------------------------------------


def test_garbage_and_truncated_lines_are_counted_with_file_and_line_never_guessed() -> None:
    good = sglang(sg_decode(12, 3000, 0.97, 3))
    lines = [
        good,                                                                    # 1 ok
        "\x00\x01 binary noise \ufffd",                                          # 2 skipped
        "",                                                                      # 3 skipped
        '{"prompt": "please explain the line Decode batch, #running-req: 99"}',  # 4 marker mid-line: skipped
        sglang("Decode batch, #running-req: 48, #token: 190709, token usage: 0.9"),  # 5 truncated
        sglang("Prefill batch, #new-seq: 1, #new-token: 812, #cached-tok"),      # 6 truncated
        sglang("KV cache pool is full. Retract requests. #retracted_reqs: "),    # 7 truncated
        vllm("Engine 000: Avg prompt throughput: 1.0 tokens/s, Avg gen"),       # 8 truncated
        vllm(v1_stats(3, 1, 50.0)).rsplit("%", 2)[0],                           # 9 truncated in the usage
        "Decode batch, #running-req: 1, #token: 3, token usage: 0.01, cuda graph: True, "
        "gen throughput (token/s): 1.00, #queue-req: 0",                         # 10 no timestamp prefix
        sglang('INFO:     127.0.0.1:5000 - "GET /health HTTP/1.1" 200 OK'),      # 11 skipped
        sglang(sg_decode(12, 3000, 0.97, 3)).replace("token usage: 0.97", "token usage: high"),  # 12 bad value
        sglang(sg_decode(12, 3000, 0.97, 3)).replace("2026-11-29", "2026-13-45"),  # 13 impossible date
        "2026-11-29T25:00:00Z " + sglang(sg_decode(12, 3000, 0.97, 3)),          # 14 impossible hour
    ]
    samples, stream = read(lines)
    report = stream.report
    assert [p.where for p in report.problems] == [f"app.log:{n}" for n in (5, 6, 7, 8, 9, 10, 12, 13, 14)]
    assert report.unparsed == 9 and report.lines == 14 and report.engine_lines == 1
    assert "month must be in 1..12" in report.problems[7].reason
    assert "no engine log prefix" in report.problems[5].reason
    assert report.problems[0].format == "SGLang 'Decode batch' line"
    assert len(samples) == 1 and samples[0].usage_ratio == 0.97  # not the truncated 0.9
    text = "\n".join(report.describe())
    assert "app.log:5: SGLang 'Decode batch' line: does not match" in text


def test_a_log_is_read_lazily_in_one_pass() -> None:
    consumed = 0

    def endless() -> Iterator[str]:
        nonlocal consumed
        i = 0
        while True:
            consumed += 1
            i += 1
            at = T0 + timedelta(seconds=i)
            yield (sglang(sg_decode(i, 100, 0.5, 0), at=at) if i % 1000 == 0 else "noise line " * 10) + "\n"

    stream = read_log(endless(), name="endless")
    first = next(stream)
    assert first.running == 1000 and consumed == 1000  # nothing was read ahead
    second = next(stream)
    assert second.running == 2000 and consumed == 2000
    stream.close()


def test_follow_reads_lines_appended_while_it_runs(tmp_path: Path) -> None:
    path = tmp_path / "live.log"
    path.write_text(sglang(sg_decode(1, 100, 0.10, 0)) + "\n")
    stop = threading.Event()
    got: list[PoolSample] = []

    def writer() -> None:
        time.sleep(0.3)
        with open(path, "a") as fh:
            fh.write(sglang(sg_decode(2, 100, 0.20, 1), at=T0 + timedelta(seconds=4)) + "\n")
            fh.flush()
            time.sleep(0.3)
            half = sglang(sg_decode(3, 100, 0.30, 2), at=T0 + timedelta(seconds=8))
            fh.write(half[:40])  # a line in the middle of being written
            fh.flush()
            time.sleep(0.3)
            fh.write(half[40:] + "\n")
            fh.flush()
        deadline = time.monotonic() + hang_guard(1)
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()

    thread = threading.Thread(target=writer)
    thread.start()
    stream = read_log(path, follow=True, stop=stop, poll_interval=0.05, follow_timeout=hang_guard(1))
    for s in stream:
        got.append(s)
    thread.join()
    assert [(s.running, s.waiting) for s in got] == [(1, 0), (2, 1), (3, 2)]
    assert stream.report.unparsed == 0  # the half-written line waited for its newline


def test_follow_starts_over_after_truncation_and_stops_when_idle(tmp_path: Path) -> None:
    path = tmp_path / "rotating.log"
    path.write_text("".join(sglang(sg_decode(i, 100, 0.1, 0), at=T0 + timedelta(seconds=i)) + "\n" for i in range(1, 4)))

    # The file is cut right after the third line is read, by the reader's own thread: the idle
    # deadline (1 s) then runs from the fourth line on, however busy the machine.
    stream = read_log(path, follow=True, poll_interval=0.05, follow_timeout=1.0)
    samples = [next(stream) for _ in range(3)]
    with open(path, "w") as fh:  # copytruncate: same inode, shorter file
        fh.write(sglang(sg_decode(9, 100, 0.9, 5), at=T0 + timedelta(seconds=60)) + "\n")
    written = time.monotonic()
    samples += list(stream)  # ends by itself: idle for follow_timeout (a hang here is the bug)
    assert [s.running for s in samples] == [1, 2, 3, 9]
    assert samples[-1].provenance["running"].metric == f"{path}:1"  # line numbers restart with the file
    assert time.monotonic() - written >= 1.0  # not before the idle deadline (read after the last line)


# --- the command line ---------------------------------------------------------------------------


def test_inspect_log_json_names_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    story = saturation_story("sglang", healthy_s=20, saturated_s=40)
    path = story.write(tmp_path / "server.log")
    with open(path, "a") as fh:
        fh.write(sglang("Decode batch, #running-req: 3, #tok") + "\n")
    assert main(["inspect", "--log", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    (inst,) = doc["instances"]
    assert inst["instance"] == str(path) and inst["engine"] == "sglang"
    assert inst["samples"] > 10 and inst["kv_usage"] >= 0.98
    assert inst["evictions_total"] == story.evictions
    assert inst["provenance"]["usage_ratio"].startswith(f"{path}:")
    (log,) = doc["logs"]
    assert log["unparsed"] == 1 and log["problems"][0]["where"] == f"{path}:{len(story.lines) + 1}"
    assert f"{path}:{len(story.lines) + 1}" in captured.err


def test_inspect_log_from_stdin_in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    text = vllm(v1_stats(7, 2, 88.0, preemptions=1)) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["inspect", "--log", "-", "--json", "--log-year", "2026"]) == 0
    (inst,) = json.loads(capsys.readouterr().out)["instances"]
    assert (inst["instance"], inst["running"], inst["waiting"], inst["kv_usage"]) == ("- engine=0", 7, 2, 0.88)
    assert inst["ts"] == TS0 and inst["provenance"]["running"].startswith("-:1 ")


def test_inspect_log_from_a_pipe() -> None:
    text = "".join(line + "\n" for line in saturation_story("vllm", healthy_s=30, saturated_s=30).lines)
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "inspect", "--log", "-", "--json", "--log-year", "2026"],
                          input=text, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (inst,) = json.loads(proc.stdout)["instances"]
    assert inst["instance"] == "- engine=0" and inst["kv_usage"] >= 0.99 and inst["evictions_total"] > 0


def test_inspect_follow_streams_json_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "f.log"
    path.write_text(sglang(sg_decode(1, 100, 0.1, 0)) + "\n" + sglang(sg_decode(2, 100, 0.2, 0), at=T0 + timedelta(seconds=4)) + "\n")
    assert main(["inspect", "--log", str(path), "--follow", "--follow-timeout", "0.3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["running"] for r in rows] == [1, 2]


def test_inspect_follow_prints_the_last_state_with_provenance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping of the long temporary path
    path = tmp_path / "t.log"
    path.write_text(sglang(sg_decode(41, 100, 0.97, 17), "DP1 TP0") + "\n")
    assert main(["inspect", "--log", str(path), "--follow", "--follow-timeout", "0.3", "--provenance"]) == 0
    out = capsys.readouterr().out
    assert "41 / 17" in out and f"{path}:1" in out and "'#queue-req'" in out


def test_inspect_log_refuses_what_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.log"
    empty.write_text("nothing to see\n")
    assert main(["inspect", "--log", str(empty)]) == 3
    assert "no SGLang or vLLM stats lines" in capsys.readouterr().err
    assert main(["inspect", "--log", str(empty), "--log", str(empty), "--follow"]) == 3
    assert main(["inspect", "--log", str(tmp_path / "missing.log")]) == 3
    assert main(["inspect", "--log", str(empty), "--log-tz", "Nowhere/Land"]) == 3


# --- diagnose --log: the same verdicts from log lines, evidence naming the lines -------------


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_diagnose_log_saturation_story_is_l1_bottleneck(engine: str, tmp_path, capsys) -> None:
    from kvdiag.cli import main as kvdiag_main

    story = saturation_story(engine, tp=2 if engine == "sglang" else 1)
    path = tmp_path / f"{engine}.log"
    story.write(path)
    code = kvdiag_main(["diagnose", "--log", str(path), "--log-year", str(story.year), "--json"])
    report = json.loads(capsys.readouterr().out)
    [inst] = report["instances"]
    assert inst["verdict"] == "l1_kv_bottleneck" and code == 2
    usage = inst["checks"]["kv_usage_saturated"]["evidence"]
    assert re.search(rf"{re.escape(str(path))}:\d+", usage["sources"]["usage_ratio"])
    assert inst["checks"]["ttft_p99_high"]["status"] == "unknown"  # no TTFT histogram in logs


@pytest.mark.parametrize(("usage", "verdict"), [(40.0, "healthy"), (99.0, "near_kv_capacity")])
def test_diagnose_vllm_log_without_preemptions_follows_the_table(usage: float, verdict: str, tmp_path, capsys) -> None:
    """E is unknown (the line cannot carry it): an idle pool is healthy whatever E would be; a
    pinned pool without a queue is near capacity or under pressure, depending on E: near capacity
    at least, and the reason says E could raise it."""
    path = tmp_path / "v.log"
    path.write_text("".join(vllm(v1_stats(20, 0, usage), T0 + timedelta(seconds=10 * i)) + "\n" for i in range(40)))
    code = main(["diagnose", "--log", str(path), "--log-year", "2026", "--json"])
    [inst] = json.loads(capsys.readouterr().out)["instances"]
    assert inst["verdict"] == verdict and inst["checks"]["evictions_growing"]["status"] == "unknown"
    assert inst["checks"]["evictions_growing"]["evidence"]["summary"].startswith("evictions_total absent: this vLLM")
    if verdict == "healthy":
        assert code == 0 and "unknown, but the answer is the same either way" in inst["reason"]
    else:
        assert code == 0 and "l1_kv_pressure" in inst["reason"] and "unknown" in inst["reason"]


def test_diagnose_log_follow_rediagnoses_as_lines_arrive(tmp_path) -> None:
    story = saturation_story("vllm")
    path = tmp_path / "live.log"
    half = len(story.lines) // 4
    path.write_text("".join(line + "\n" for line in story.lines[:half]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdiag", "diagnose", "--log", str(path), "--follow", "--follow-timeout", str(hang_guard(10)),
         "--log-year", str(story.year), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()

    def printed(word: str) -> bool:  # the verdict on stderr, or the process gone; a hang guard
        deadline = time.monotonic() + hang_guard(10)
        while not any(word in line for line in list(lines)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return any(word in line for line in list(lines))

    assert printed("healthy"), lines  # the first quarter is diagnosed before the rest arrives
    with path.open("a") as fh:
        for line in story.lines[half:]:
            fh.write(line + "\n")
    assert printed("l1_kv_bottleneck"), lines
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the report of what was followed
    out = proc.stdout.read()  # type: ignore[union-attr]
    proc.wait(timeout=hang_guard(10))
    reader.join(timeout=hang_guard(1))
    err = "".join(lines)
    assert proc.returncode == 2, err
    assert "healthy" in err and "l1_kv_bottleneck" in err  # the verdict moved while following
    assert json.loads(out)["instances"][0]["verdict"] == "l1_kv_bottleneck"
