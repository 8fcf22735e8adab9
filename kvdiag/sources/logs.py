"""Server logs as a source: SGLang and vLLM log lines to the PoolSample stream of the metric path.

Many SGLang deployments never pass ``--enable-metrics``, and during an incident the log is often
all there is. Both engines log what the checklist needs (grammar: ``logformats.py``):

- SGLang: ``Decode batch`` lines every ``decode_log_interval`` (40) decode steps and ``Prefill
  batch`` lines for every prefill batch give running, waiting and the pool's active share (token
  granularity, 2 decimals); every retraction logs ``#retracted_reqs: N``, summed here into
  ``evictions_total``; prefill lines' ``#new-token`` / ``#cached-token`` add up to the prefix-cache
  counters. The retract line's ``#new_token_ratio: A -> B`` is the admission reserve ratio.
- vLLM V1: one line per engine every 10 s (``VLLM_LOG_STATS_INTERVAL``; none while idle) with
  running, waiting, KV usage (block granularity, 1 decimal of a percent) and the hit rate of the
  last 1000 requests. Its per-interval ``Preemptions: N`` field is never printed by any release
  read (``logformats.VLLM_PREEMPTIONS_*``): absent is not zero, so ``evictions_total`` stays absent,
  with a note that says why and how to get it, until a line shows the field (a build that prints it).
  V0 prints ``Running/Swapped/Pending`` lines, a separate hit-rate line, and
  ``total_num_cumulative_preemption=N`` on every 50th preemption.

Instances: the file (or ``-``) plus what splits it, as the metric path keys them: SGLang's
``DP{d}`` tag gives ``dp_rank=d``; vLLM's ``Engine 000:`` gives ``engine=0``; a collector's name
(``kubectl --prefix`` pod, compose service, journald host/ident) gives ``source=``.
SGLang TP/PP ranks of one replica repeat one pool: only attention-TP rank 0 prints stats lines,
but every rank prints retract warnings, so kvdiag keeps PP0 and TP0. A stats line from another TP
rank means ``--enable-dp-attention`` (each attention-TP leader owns a pool): that rank becomes its
own instance (``tp_rank=t``) and its retract lines count from then on. The rank tags EP, MOE_DP and
ATTN_CP follow from the TP rank and play no part.

Timestamps come from the lines. A collector's RFC 3339 stamp (docker/kubectl ``--timestamps``,
journald short-iso) carries its zone and wins. Otherwise SGLang's local time is read in ``tz``
(UTC by default) and vLLM's ``MM-DD`` in ``year`` (default: the current year, or the previous one
when that would put the log in the future; December to January rolls the year over).

Docker's json-file records (``dockerjson.py``) are unwrapped before anything else, their ``time``
the zoned stamp. A log whose lines look like engine stats but none parses warns (``LogReport.warning``).

Everything streams: one pass, constant memory, a generator of samples; ``follow`` keeps
reading what is appended (tail -f), across rotation and truncation.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Iterable, Iterator, TextIO
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kvdiag.engines.base import instance_key
from kvdiag.model import PoolSample, Provenance
from kvdiag.sources.dockerjson import unwrap
from kvdiag.sources.logformats import (
    VLLM_PREEMPTIONS_ADDED,
    VLLM_PREEMPTIONS_NEVER_PRINTED_THROUGH,
    VLLM_V0,
    LogLine,
    Mention,
    parse,
    vllm_preemptions_field,
)

#: Problems kept with their text (the count goes on); bounds memory on a log full of garbage.
MAX_PROBLEMS = 50

NO_HISTOGRAMS = "logs carry no TTFT or queue-time histogram: the P99 TTFT checks report unknown"
ENGINE_NOTES: dict[str, tuple[str, ...]] = {
    "sglang": (
        "from the server log: SGLang prints a Decode batch line every decode_log_interval (40) "
        "decode steps and a Prefill batch line per prefill batch; the pool between lines is not seen",
        NO_HISTOGRAMS,
    ),
    "vllm": (
        "from the server log: vLLM prints one stats line per engine every VLLM_LOG_STATS_INTERVAL "
        "(10 s; V0: 5 s) and none while the engine is idle (a gap means idle, not missing data)",
        NO_HISTOGRAMS,
    ),
}


def _release(release: tuple[int, int, int]) -> str:
    return ".".join(map(str, release))


#: Why a vLLM V1 log carries no eviction count, by what the version's stats line does with the
#: field (``logformats.vllm_preemptions_field``). A note starting with the field's name: the
#: evictions check quotes it as the reason it is unknown.
_RESET = (
    "LoggingStatLogger.log() resets the interval's count before formatting the line, so no release "
    f"from {_release(VLLM_PREEMPTIONS_ADDED)} to {_release(VLLM_PREEMPTIONS_NEVER_PRINTED_THROUGH)} prints it, "
    "even while the engine preempts"
)
_NEVER = f"prints no 'Preemptions' field in its periodic stats line ({_RESET})"
PREEMPTIONS_WHY = {
    "none": f"has no 'Preemptions' field in its periodic stats line (added in {_release(VLLM_PREEMPTIONS_ADDED)}; {_RESET})",
    "never printed": _NEVER,
    "unknown": _NEVER,
}
PREEMPTIONS_UNSEEN = (
    "evictions_total absent: {who} {why}; the stats lines {lines} would have carried it. Preemptions are "
    "not 0, they are unseen: read vllm:num_preemptions_total from /metrics or a Prometheus server, or log "
    "with a build whose stats line prints the field"
)


@dataclass
class LogProblem:
    """A line that looked like engine stats but did not parse: where, which format, why."""

    where: str
    format: str
    reason: str
    text: str


@dataclass
class LogReport:
    """What a pass over a log read, skipped and could not parse (updated while streaming)."""

    name: str
    lines: int = 0
    engine_lines: int = 0  # lines read by a grammar (stats lines, retract/preemption warnings)
    samples: int = 0
    duplicate_rank_lines: int = 0  # SGLang lines of a TP/PP rank that repeats another's pool
    unparsed: int = 0
    problems: list[LogProblem] = field(default_factory=list)  # the first MAX_PROBLEMS of them
    mentions: int = 0  # lines naming a stats marker that hold no engine line (skipped)
    first_mention: LogProblem | None = None
    assumptions: list[str] = field(default_factory=list)

    def problem(self, lineno: int, line: LogLine, raw: str) -> None:
        self.unparsed += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(LogProblem(f"{self.name}:{lineno}", line.fmt.title, line.reason, _shown(raw)))

    def mention(self, lineno: int, line: Mention, raw: str) -> None:
        self.mentions += 1
        if self.first_mention is None:
            self.first_mention = LogProblem(
                f"{self.name}:{lineno}", f"a line naming '{line.marker}'",
                "no engine log line at its start, under any wrapper kvdiag reads", _shown(raw))

    def warning(self) -> str | None:
        """Set when lines look like engine stats and none was read: the log is wrapped or
        written in a way kvdiag does not read, and an empty diagnosis must not look healthy."""
        looked = self.unparsed + self.mentions
        if self.engine_lines or not looked:
            return None
        example = self.problems[0] if self.problems else self.first_mention
        assert example is not None
        return (
            f"warning: {looked} line(s) look like engine stats and none parses (a wrapper or format kvdiag "
            f"does not read?), e.g. {example.where}: {example.text!r}"
        )

    def assume(self, text: str) -> None:
        if text not in self.assumptions:
            self.assumptions.append(text)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> list[str]:
        """Human lines for stderr: what was read, and each line that could not be."""
        out = [
            f"{self.name}: {self.lines} lines, {self.engine_lines} engine stats lines, {self.samples} samples"
            + (f", {self.duplicate_rank_lines} duplicate TP/PP-rank lines skipped" if self.duplicate_rank_lines else "")
        ]
        out += [f"assumed: {a}" for a in self.assumptions]
        warning = self.warning()
        if warning:
            out.append(warning)
        if self.unparsed:
            out.append(f"{self.unparsed} line(s) look like engine stats but do not parse (not used):")
            out += [f"  {p.where}: {p.format}: {p.reason}: {p.text!r}" for p in self.problems]
            if self.unparsed > len(self.problems):
                out.append(f"  ... and {self.unparsed - len(self.problems)} more")
        return out


def _shown(raw: str) -> str:
    """A problem line as reports quote it: no line end, at most 200 characters."""
    return raw.rstrip("\r\n")[:200]


def parse_tz(value: str | tzinfo | None) -> tzinfo:
    """A zone from an IANA name, ``UTC``/``Z`` or an offset ``+05:30``; None means UTC."""
    if value is None:
        return timezone.utc
    if isinstance(value, tzinfo):
        return value
    text = value.strip()
    if text.upper() in ("UTC", "Z"):
        return timezone.utc
    m = re.fullmatch(r"([+-])(\d{2}):?(\d{2})", text)
    if m:
        delta = timedelta(hours=int(m[2]), minutes=int(m[3]))
        return timezone(-delta if m[1] == "-" else delta)
    try:
        return ZoneInfo(text)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {value!r}: give an IANA name (Europe/Paris), UTC or +HH:MM") from None


_ZONED = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(\.\d+)?(?:Z|([+-])(\d\d):?(\d\d))$")


class Clock:
    """Unix seconds from one log's timestamps, and the assumptions that took.

    Consecutive lines mostly share their second, so the last conversion is cached.
    """

    def __init__(self, year: int | None = None, tz: str | tzinfo | None = None) -> None:
        self.tz = parse_tz(tz)
        self.year = year
        self._year_given = year is not None
        self._last_month = 0
        self._key = ""
        self._base = 0.0
        self._said: dict[tuple[str, int | None], str | None] = {}

    def assumption(self, kind: str) -> str | None:
        """What a stamp of ``kind`` had to assume, as a sentence; None when nothing."""
        key = (kind, self.year)
        if key not in self._said:
            self._said[key] = self._assumption(kind)
        return self._said[key]

    def _assumption(self, kind: str) -> str | None:
        zone = "UTC" if self.tz is timezone.utc else str(self.tz)
        if kind == "ymd":
            return f"SGLang timestamps carry no zone: read as {zone} (--log-tz / tz= to change)"
        if kind == "md":
            how = "as given" if self._year_given else "the current year, or the previous one if that is in the future"
            return (
                f"vLLM timestamps carry no year or zone: read in {self.year} ({how}) and {zone} "
                "(--log-year / --log-tz to change)"
            )
        return None

    def unix(self, stamp: str, kind: str) -> float:
        if kind == "zoned":
            return self._zoned(stamp)
        cut = 19 if kind == "ymd" else 14  # the stamp up to its seconds
        key, frac = stamp[:cut], stamp[cut + 1 :]
        if key != self._key:
            self._base = self._local(key, kind)
            self._key = key
        return self._base + (float("0." + frac) if frac else 0.0)

    def _local(self, key: str, kind: str) -> float:
        """``YYYY-MM-DD HH:MM:SS`` or ``MM-DD HH:MM:SS`` in ``tz``; ValueError when out of range."""
        if kind == "ymd":
            return self._at(int(key[:4]), key[5:])
        month = int(key[:2])
        if self.year is None:
            self.year = datetime.now(timezone.utc).year
            if self._at(self.year, key) > time.time() + 86400:
                self.year -= 1
        elif self._last_month - month >= 6:  # December, then January: a new year
            self.year += 1
        self._last_month = month
        return self._at(self.year, key)

    def _at(self, year: int, md_hms: str) -> float:
        m, d, hh, mm, ss = (int(md_hms[i : i + 2]) for i in (0, 3, 6, 9, 12))
        return datetime(year, m, d, hh, mm, ss, tzinfo=self.tz).timestamp()

    @staticmethod
    def _zoned(stamp: str) -> float:
        m = _ZONED.match(stamp)
        if m is None:
            raise ValueError(f"not an RFC 3339 timestamp: {stamp!r}")
        secs = datetime(*(int(m[i]) for i in range(1, 7)), tzinfo=timezone.utc).timestamp()  # checks ranges
        frac = float(m[7]) if m[7] else 0.0
        offset = (int(m[9]) * 3600 + int(m[10]) * 60) * (-1 if m[8] == "-" else 1) if m[8] else 0
        return secs + frac - offset


@dataclass
class _Instance:
    """Running state of one instance: the counters the log only gives as events."""

    key: str
    engine: str
    split: dict[str, str]
    first_line: int
    evictions: float | None = None
    eviction_lines: int = 0
    eviction_prov: Provenance | None = None
    reserve: tuple[float, int] | None = None  # the last retraction's ratio since the last sample
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    prefill_lines: int = 0
    prefix_provs: tuple[Provenance, Provenance] | None = None
    saw_preemptions: bool = False
    preemptions_from: int = 0  # the first line that printed vLLM's 'Preemptions' field
    v0_hit: tuple[float, int] | None = None
    last: PoolSample | None = None
    pending_ts: float | None = None  # a counter moved after the last sample, at this time


class _Assembler:
    """Turns parsed lines into PoolSamples, one per stats line, with the counters so far."""

    def __init__(self, name: str, clock: Clock, report: LogReport) -> None:
        self.name = name
        self.clock = clock
        self.report = report
        self.instances: dict[str, _Instance] = {}
        self.pools: set[tuple[str | None, int | None, int]] = set()  # SGLang ranks that print stats
        self.versions: dict[str | None, tuple[str, int]] = {}  # vLLM version and its line, by collector source

    def feed(self, lineno: int, line: LogLine, ts: float) -> PoolSample | None:
        if line.fmt.key == "vllm_version":
            self.versions[line.source] = ((line.fields or {})["version"], lineno)
            return None
        inst = self._instance(lineno, line)
        if inst is None:
            return None
        note = self.clock.assumption(line.stamp_kind)
        if note:
            self.report.assume(note)
        handler = getattr(self, "_" + line.fmt.key)
        return handler(inst, lineno, line.fields or {}, line, ts, note)

    def flush(self) -> Iterator[PoolSample]:
        """A last sample where a counter moved after an instance's last stats line."""
        for inst in self.instances.values():
            if inst.last is None or inst.pending_ts is None:
                continue
            ps = dataclasses.replace(
                inst.last, ts=inst.pending_ts, provenance=dict(inst.last.provenance), notes=list(inst.last.notes)
            )
            ps.notes.append("last sample, at the last warning after the final stats line: gauges are that line's")
            self._counters(inst, ps)
            yield ps

    # -- instances ---------------------------------------------------------------------------

    def _instance(self, lineno: int, line: LogLine) -> _Instance | None:
        split: dict[str, str] = {}
        if line.fmt.engine == "sglang":
            ranks = line.ranks
            tp = ranks.get("TP", 0)
            pool = (line.source, ranks.get("DP"), tp)
            if line.fmt.key != "sglang_retract":
                self.pools.add(pool)
            if ranks.get("PP", 0) != 0 or (tp != 0 and pool not in self.pools):
                self.report.duplicate_rank_lines += 1
                return None
            if "DP" in ranks:
                split["dp_rank"] = str(ranks["DP"])
            if tp != 0:
                split["tp_rank"] = str(tp)
        elif line.fields:
            if line.fields.get("engine") is not None:
                split["engine"] = str(int(line.fields["engine"]))
            elif line.fields.get("aggregated") is not None:
                split["engines_aggregated"] = line.fields["aggregated"]
        if line.source:
            split["source"] = line.source
        key = instance_key(self.name, split)
        inst = self.instances.get(key)
        if inst is None:
            inst = self.instances[key] = _Instance(key, line.fmt.engine, split, lineno)
        return inst

    def _sample(self, inst: _Instance, ts: float, note: str | None) -> PoolSample:
        ps = PoolSample(inst.key, inst.engine, ts, labels=dict(inst.split), notes=list(ENGINE_NOTES[inst.engine]))
        if note:
            ps.notes.append(note)
        return ps

    def _emit(self, inst: _Instance, ps: PoolSample) -> PoolSample:
        self._counters(inst, ps)
        inst.last = ps
        inst.pending_ts = None
        self.report.samples += 1
        return ps

    def _counters(self, inst: _Instance, ps: PoolSample) -> None:
        if inst.evictions is not None and inst.eviction_prov is not None:
            ps.set("evictions_total", inst.evictions, inst.eviction_prov)
        if inst.prefix_provs is not None:
            ps.set("prefix_hit_tokens_total", inst.prefix_hits, inst.prefix_provs[0])
            ps.set("prefix_query_tokens_total", inst.prefix_queries, inst.prefix_provs[1])

    def _where(self, lineno: int) -> str:
        return f"{self.name}:{lineno}"

    # -- SGLang --------------------------------------------------------------------------------

    def _sglang_pool(self, inst: _Instance, lineno: int, f: dict[str, str], line: LogLine, ts: float, note: str | None) -> PoolSample:
        """Decode and Prefill lines: the same gauges, in one grammar's group names."""
        title = line.fmt.title
        where = self._where(lineno)
        ps = self._sample(inst, ts, note)
        ps.set("running", float(f["running"]), Provenance(where, note=f"{title}, field '#running-req'"))
        ps.set("waiting", float(f["queue"]), Provenance(where, note=f"{title}, field '#queue-req'"))
        if f["usage"] is not None:
            usage = float(f["usage"])
            prov = Provenance(where, note=f"{title}, field 'token usage' (active share, 2 decimals)")
        else:
            parts = {k: float(f[k]) for k in ("full_usage", "swa_usage", "mamba_usage") if f.get(k) is not None}
            usage = max(parts.values())
            names = ", ".join(f"'{k.replace('_usage', '')} usage'" for k in parts)
            prov = Provenance(where, derived=len(parts) > 1,
                              note=f"{title}: max of {names} (as the token_usage gauge; 2 decimals)")
        ps.set("usage_ratio", usage, prov)
        ps.usage_granularity = "token"
        used = f.get("token") or f.get("full_token")
        if used is not None:
            label = "#token" if f.get("token") is not None else "#full token"
            ps.set("used_tokens", float(used), Provenance(where, note=f"{title}, field '{label}' (total - available - evictable)"))
        if inst.evictions is None:
            inst.evictions = 0.0
            inst.eviction_prov = Provenance(
                f"{self.name}:{inst.first_line}", derived=True,
                note=f"no retract warning from line {inst.first_line} on: 0 (SGLang logs every retraction)",
            )
        if inst.reserve is not None:
            ratio, at = inst.reserve
            ps.set("decode_reserve_ratio", ratio, Provenance(
                self._where(at), note="SGLang retract warning, '#new_token_ratio: A -> B' (B); the engine "
                "decays it every decode step, so samples after the next stats line leave it absent"))
            inst.reserve = None
        return self._emit(inst, ps)

    _sglang_decode = _sglang_pool

    def _sglang_prefill(self, inst: _Instance, lineno: int, f: dict[str, str], line: LogLine, ts: float, note: str | None) -> PoolSample:
        cached, new = float(f["cached"]), float(f["new_token"])
        inst.prefix_hits += cached
        inst.prefix_queries += cached + new
        inst.prefill_lines += 1
        since = f"over {inst.prefill_lines} Prefill batch line(s) from line {inst.first_line} on"
        inst.prefix_provs = (
            Provenance(self._where(lineno), derived=True, note=f"sum of '#cached-token' {since}"),
            Provenance(self._where(lineno), derived=True, note=f"sum of '#new-token' + '#cached-token' {since}"),
        )
        return self._sglang_pool(inst, lineno, f, line, ts, note)

    def _sglang_retract(self, inst: _Instance, lineno: int, f: dict[str, str], line: LogLine, ts: float, note: str | None) -> None:
        inst.evictions = (inst.evictions or 0.0) + float(f["retracted"])
        inst.eviction_lines += 1
        inst.eviction_prov = Provenance(
            self._where(lineno), derived=True,
            note=f"sum of '#retracted_reqs' over {inst.eviction_lines} retract warning(s) from line "
            f"{inst.first_line} on, the last one at this line",
        )
        if f.get("new_ratio") is not None:
            inst.reserve = (float(f["new_ratio"]), lineno)
        inst.pending_ts = ts
        return None

    # -- vLLM ----------------------------------------------------------------------------------

    def _vllm_stats(self, inst: _Instance, lineno: int, f: dict[str, str], line: LogLine, ts: float, note: str | None) -> PoolSample:
        title = line.fmt.title + (f" ({line.origin})" if line.origin else "")
        where = self._where(lineno)
        ps = self._sample(inst, ts, note)
        v0 = line.grammar is VLLM_V0
        ps.set("running", float(f["running"]), Provenance(where, note=f"{title}, field 'Running'"))
        waiting_note = f"{title}, field " + ("'Pending' (V0)" if v0 else "'Waiting'")
        if f.get("deferred") is not None:
            waiting_note += f" (includes the {f['deferred']} 'Deferred' requests)"
        ps.set("waiting", float(f["waiting"]), Provenance(where, note=waiting_note))
        ps.set("usage_ratio", float(f["usage"]) / 100.0, Provenance(
            where, note=f"{title}, field '{f['device']} KV cache usage' (percent with 1 decimal, of blocks)"))
        ps.usage_granularity = "block"
        if f.get("aggregated") is not None:
            ps.notes.append(
                f"one line for {f['aggregated']} data-parallel engines: running and waiting are sums, "
                "usage is the mean over engines, so no single pool is described"
            )
        if v0:
            if inst.v0_hit is not None:
                hit, at = inst.v0_hit
                ps.set("prefix_hit_ratio_gauge", hit, Provenance(
                    self._where(at), note="vLLM V0 'Prefix cache hit rate: GPU: X%' line, printed after the "
                    "previous stats line (one interval older)"))
        else:
            self._v1_counters(inst, lineno, f, line, ps)
            if f.get("hit") is not None:
                ps.set("prefix_hit_ratio_gauge", float(f["hit"]) / 100.0, Provenance(
                    where, note=f"{title}, field 'Prefix cache hit rate': a rate over the last 1000 requests "
                    "(vLLM's CachingMetrics window), not a counter"))
        return self._emit(inst, ps)

    def _v1_counters(self, inst: _Instance, lineno: int, f: dict[str, str], line: LogLine, ps: PoolSample) -> None:
        """Preemptions, summed over intervals, only once the log shows it prints the field (a
        build that prints it does so when the count is > 0, so the earlier lines counted 0)."""
        count = f.get("preemptions")
        if count is None and not inst.saw_preemptions:
            ps.notes.append(self._preemptions_unseen(inst, lineno, line))
            return
        if not inst.saw_preemptions:
            inst.saw_preemptions, inst.evictions = True, 0.0
            inst.preemptions_from = lineno
        inst.evictions = (inst.evictions or 0.0) + (float(count) if count is not None else 0.0)
        inst.eviction_lines += 1
        inst.eviction_prov = Provenance(
            self._where(lineno), derived=True,
            note=f"sum of the per-interval 'Preemptions' over {inst.eviction_lines} stats line(s) from line "
            f"{inst.preemptions_from} on (the first to print the field; this build prints it when > 0, "
            f"so a line without it counts 0 and the lines from {inst.first_line} before it counted 0)",
        )

    def _preemptions_unseen(self, inst: _Instance, lineno: int, line: LogLine) -> str:
        version = self.versions.get(line.source)
        field = vllm_preemptions_field(version[0] if version else None)
        if version is None:
            who = "this vLLM (its version is not in the log: no 'Initializing a V1 LLM engine (vX)' line)"
        elif field == "unknown":
            who = f"vLLM {version[0]} ({self._where(version[1])}; newer than the releases kvdiag has read) so far"
        else:
            who = f"vLLM {version[0]} ({self._where(version[1])})"
        lines = f"{self._where(inst.first_line)} to {self._where(lineno)}"
        return PREEMPTIONS_UNSEEN.format(who=who, why=PREEMPTIONS_WHY[field], lines=lines)

    def _vllm_v0_hit(self, inst: _Instance, lineno: int, f: dict[str, str], line: LogLine, ts: float, note: str | None) -> None:
        inst.v0_hit = (float(f["hit"]) / 100.0, lineno)
        return None

    def _vllm_v0_preempt(self, inst: _Instance, lineno: int, f: dict[str, str], line: LogLine, ts: float, note: str | None) -> None:
        inst.evictions = float(f["total"])
        inst.eviction_prov = Provenance(
            self._where(lineno),
            note="vLLM V0 preemption warning, 'total_num_cumulative_preemption': the engine's own count, "
            "logged at preemptions 1, 51, 101, ... (a lower bound between warnings; absent before the first)",
        )
        inst.pending_ts = ts
        return None


def _numbered_lines(
    source: str | os.PathLike[str] | Iterable[str],
    follow: bool,
    stop: threading.Event | None,
    follow_timeout: float | None,
    poll_interval: float,
) -> Iterator[tuple[int, str]]:
    """(line number, text) of a path, ``-`` (stdin), or an open text file or other iterable of lines.

    With ``follow`` on a path, keeps reading what is appended (tail -f) until ``stop`` is set or
    nothing new came for ``follow_timeout`` seconds; a partial last line waits for its newline;
    a rotated file (new inode) or a truncated one is read again from its start (numbers restart).
    """
    if not isinstance(source, (str, os.PathLike)) or str(source) == "-":
        fh = source if not isinstance(source, (str, os.PathLike)) else _stdin()
        yield from enumerate(fh, 1)
        return
    path = Path(source)
    fh = open(path, encoding="utf-8", errors="replace")
    try:
        if not follow:
            yield from enumerate(fh, 1)
            return
        lineno, partial, idle_since = 0, "", time.monotonic()
        while True:
            chunk = fh.readline()
            if chunk:
                idle_since = time.monotonic()
                if chunk.endswith("\n"):
                    lineno += 1
                    yield lineno, partial + chunk
                    partial = ""
                else:
                    partial += chunk
                continue
            if (stop is not None and stop.is_set()) or (
                follow_timeout is not None and time.monotonic() - idle_since >= follow_timeout
            ):
                break
            reopen = False
            try:
                reopen = os.stat(path).st_ino != os.fstat(fh.fileno()).st_ino
                truncated = os.fstat(fh.fileno()).st_size < fh.tell()
            except FileNotFoundError:  # rotated away and not yet recreated
                truncated = False
            if reopen or truncated:
                if partial:
                    lineno += 1
                    yield lineno, partial
                fh.close()
                fh = open(path, encoding="utf-8", errors="replace")
                lineno, partial = 0, ""
                continue
            if stop is not None:
                stop.wait(poll_interval)
            else:
                time.sleep(poll_interval)
        if partial:
            yield lineno + 1, partial
    finally:
        fh.close()


def _stdin() -> TextIO:
    """Standard input as UTF-8 text whatever the locale, undecodable bytes replaced (the file
    descriptor stays open); a replaced ``sys.stdin`` without one is read as it is."""
    try:
        return open(sys.stdin.fileno(), encoding="utf-8", errors="replace", closefd=False)
    except (AttributeError, OSError, io.UnsupportedOperation):
        return sys.stdin


class LogStream:
    """The PoolSamples of one log, lazily, with a ``report`` that fills in as lines are read."""

    def __init__(
        self,
        source: str | os.PathLike[str] | Iterable[str],
        *,
        name: str | None = None,
        follow: bool = False,
        year: int | None = None,
        tz: str | tzinfo | None = None,
        stop: threading.Event | None = None,
        follow_timeout: float | None = None,
        poll_interval: float = 0.25,
    ) -> None:
        if name is None:
            name = str(source) if isinstance(source, (str, os.PathLike)) else getattr(source, "name", "-")
        self.report = LogReport(str(name))
        self._clock = Clock(year, tz)
        self._lines = _numbered_lines(source, follow, stop, follow_timeout, poll_interval)
        self._samples = self._run()

    def __iter__(self) -> "LogStream":
        return self

    def __next__(self) -> PoolSample:
        return next(self._samples)

    def close(self) -> None:
        """Stop reading and close the file (also on an unfinished iteration)."""
        self._samples.close()
        self._lines.close()  # type: ignore[attr-defined]

    def _run(self) -> Iterator[PoolSample]:
        report = self.report
        assembler = _Assembler(report.name, self._clock, report)
        for lineno, raw in unwrap(self._lines):
            report.lines += 1
            line = parse(raw)
            if line is None:
                continue
            if isinstance(line, Mention):
                report.mention(lineno, line, raw)
                continue
            if line.fields is None:
                report.problem(lineno, line, raw)
                continue
            try:
                ts = self._clock.unix(line.stamp or "", line.stamp_kind)
            except ValueError as exc:
                report.problem(lineno, dataclasses.replace(line, reason=f"timestamp {line.stamp!r}: {exc}"), raw)
                continue
            report.engine_lines += line.fmt.stats
            sample = assembler.feed(lineno, line, ts)
            if sample is not None:
                yield sample
        for sample in assembler.flush():
            report.samples += 1
            yield sample


def read_log(
    source: str | os.PathLike[str] | Iterable[str],
    *,
    name: str | None = None,
    follow: bool = False,
    year: int | None = None,
    tz: str | tzinfo | None = None,
    stop: threading.Event | None = None,
    follow_timeout: float | None = None,
    poll_interval: float = 0.25,
) -> LogStream:
    """PoolSamples from an SGLang or vLLM server log: a path, ``-`` for stdin, or an open file
    (any iterable of lines).

    ``name`` is the instance prefix and the file in every provenance (default: the path, ``-``).
    ``year``/``tz`` fix what timestamps do not say (vLLM has no year; neither engine a zone).
    ``follow`` keeps reading appended lines until ``stop`` is set or ``follow_timeout`` seconds
    pass without one. The returned stream's ``report`` counts lines, samples and lines that
    looked like stats but did not parse (``report.unparsed``, with file:line in ``problems``).
    """
    return LogStream(source, name=name, follow=follow, year=year, tz=tz, stop=stop,
                     follow_timeout=follow_timeout, poll_interval=poll_interval)


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log`` and its options, shared by the commands that read logs (inspect, diagnose)."""
    parser.add_argument("--log", action="append", metavar="FILE|-",
                        help="an SGLang or vLLM server log (- for stdin; docker/kubectl/journald output works): "
                        "read the engine's periodic stats lines instead of /metrics")
    parser.add_argument("--follow", action="store_true",
                        help="with one --log FILE: keep reading lines appended to it (tail -f) until Ctrl-C")
    parser.add_argument("--follow-timeout", type=float, metavar="S",
                        help="with --follow: stop after S seconds without a new line")
    parser.add_argument("--log-year", type=int, metavar="YYYY",
                        help="year of vLLM log timestamps, which carry none (default: the current year)")
    parser.add_argument("--log-tz", metavar="ZONE",
                        help="zone of log timestamps that carry none: IANA name or +HH:MM (default UTC; "
                        "docker/kubectl/journald-iso stamps carry their own)")


def open_logs(args: argparse.Namespace) -> list[LogStream]:
    """One stream per ``--log``; raises ValueError on options that do not fit together."""
    logs = args.log or []
    if args.follow and len(logs) != 1:
        raise ValueError("--follow reads exactly one --log")
    if args.follow_timeout is not None and not args.follow:
        raise ValueError("--follow-timeout needs --follow")
    if logs.count("-") > 1:
        raise ValueError("stdin (-) can be read once")
    tz = parse_tz(args.log_tz)
    return [read_log(path, follow=args.follow, year=args.log_year, tz=tz, follow_timeout=args.follow_timeout)
            for path in logs]
