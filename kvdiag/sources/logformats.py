"""The grammar of SGLang and vLLM server log lines: one regex per line format.

Formats follow shared/facts/engine-metrics.md §1.8 (vLLM) and §2.8 (SGLang), checked against
the engines' logging code. A physical line (docker json-file records already turned into
``<time> <text>`` lines by ``dockerjson.py``) is read in three layers, each stripped in turn:

1. a collector's prefix, any of: ``kubectl logs --prefix`` (``[pod/name/container] ``),
   ``docker compose logs`` (``service-1  | ``), ``docker``/``kubectl logs --timestamps``
   (an RFC 3339 stamp) or journald ``short``/``short-iso`` (``Nov 29 11:33:15 host ident[pid]: ``);
2. the engine's logging prefix: SGLang ``[%Y-%m-%d %H:%M:%S(.mmm)( DP1)( PP0)( TP0)...] `` or vLLM
   ``(APIServer pid=N) INFO MM-DD HH:MM:SS [loggers.py:L] `` (V0: ``INFO ... metrics.py:L] ``);
3. the message, recognised by how it starts (its marker) and then read by its format's grammar.

A message that starts with a marker but does not match its grammar comes back with no fields:
the caller counts and reports it, and never guesses a value from it. This module is pure text
handling; time zones, years, instances and samples are the caller's business (``logs.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: ANSI colour codes (vLLM colours its prefix when writing to a TTY).
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: A cheap first look at a raw line: lines without any of these are never engine stats.
MARKERS = re.compile(
    r"Decode batch|Prefill batch|Retract requests\.|Decode out of memory happened|"
    r"Avg prompt throughput:|Prefix cache hit rate: GPU:|total_num_cumulative_preemption=|"
    r"LLM engine \(v|server version |▀▄▀ █"
)
#: The markers of vLLM's start-up version lines (a named group would slow every search 2-3x).
VERSION_MARKERS = frozenset(("LLM engine (v", "server version ", "▀▄▀ █"))

COLLECTOR = re.compile(
    r"""
    (?:\[(?P<k8s>[^\]\s/]+/[^\]\s]+)\]\ )?          # kubectl logs --prefix
    (?:(?P<compose>[\w.-]+)\ +\|\ )?                 # docker compose logs
    (?:                                              # journald short / short-iso (+ -precise)
        (?:(?P<jshort>[A-Z][a-z]{2}\ [\ \d]\d\ \d{2}:\d{2}:\d{2}(?:\.\d+)?)
          |(?P<jiso>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?[+-]\d{2}:?\d{2}))
        \ (?P<host>\S+)\ (?P<ident>[^\s\[:]+)(?:\[\d+\])?:\ 
      | (?P<rfc>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2}))\     # docker/kubectl -t
    )?
    """,
    re.X,
)

SGLANG_HEAD = re.compile(
    r"\[(?P<ymd>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d{1,6})?)(?P<ranks>(?: [A-Z][A-Z_]*\d+)*)\] "
)

VLLM_HEAD = re.compile(
    r"(?:\((?P<proc>[^()]*)\) )?.*?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"(?P<md>\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:[.,]\d{1,6})?) \[?(?P<src>[^\]\s]+:\d+)\] "
)

RANK = re.compile(r" ([A-Z][A-Z_]*?)(\d+)")

#: Which format a message is in, from how it starts.
KIND = re.compile(
    r"(?P<sglang_decode>Decode batch)"
    r"|(?P<sglang_prefill>Prefill batch)"
    r"|(?P<sglang_retract>KV cache pool is full\. Retract requests\.|Decode out of memory happened\.)"
    r"|(?P<vllm_stats>(?:Engine \d+: |\d+ Engines Aggregated: )?Avg prompt throughput)"
    r"|(?P<vllm_v0_hit>Prefix cache hit rate: GPU:)"
    r"|(?P<vllm_v0_preempt>Sequence group \S+ is preempted)"
    r"|(?P<vllm_version>Initializing a V1 LLM engine \(v|vLLM (?:API )?server version |.*█ ▀▄▀ █)"
)

_U = r"\d+\.\d+"  # a ratio printed with a fixed number of decimals

SGLANG_DECODE = re.compile(
    rf"""
    Decode\ batch(?:\ \[\d+\])?[.,]\ 
    \#running-req:\ (?P<running>\d+),\ 
    (?:\#cached-token:\ \d+,\ )?
    (?:\#token:\ (?P<token>\d+),\ token\ usage:\ (?P<usage>{_U})
      |\#full\ token:\ (?P<full_token>\d+),\ full\ token\ usage:\ (?P<full_usage>{_U})
       (?:,\ \#swa\ token:\ \d+,\ swa\ token\ usage:\ (?P<swa_usage>{_U}))?
       (?:,\ mamba\ num:\ \d+,\ mamba\ usage:\ (?P<mamba_usage>{_U}))?
    ),\ 
    (?:accept\ len:\ {_U},\ (?:accept\ rate:\ {_U},\ )?)?
    (?:(?!gen\ throughput|\w+\ graph:)[^,:]+:\ [^,]+,\ )*
    (?:\w+\ graph:\ (?:True|False),\ )?
    gen\ throughput\ \(token/s\):\ (?:\d+\.\d+|nan|inf),\ 
    (?:largest-len:\ \d+,\ )?
    \#queue-req:\ (?P<queue>\d+)
    (?:,\ [^,:]+:\ [^,]+)*
    ,?\ ?$
    """,
    re.X,
)

SGLANG_PREFILL = re.compile(
    rf"""
    Prefill\ batch(?:\ \[\d+\])?[.,]\ 
    \#new-seq:\ \d+,\ \#new-token:\ (?P<new_token>\d+),\ \#cached-token:\ (?P<cached>\d+),\ 
    (?:token\ usage:\ (?P<usage>{_U})
      |full\ token\ usage:\ (?P<full_usage>{_U})
       (?:,\ swa\ token\ usage:\ (?P<swa_usage>{_U}))?
       (?:,\ mamba\ usage:\ (?P<mamba_usage>{_U}))?
    ),\ 
    \#running-req:\ (?P<running>\d+),\ \#queue-req:\ (?P<queue>\d+)
    (?:,\ [^,:]+:\ [^,]+)*
    ,?\ ?$
    """,
    re.X,
)

#: One possessive loop over the fields (``*+``: an iteration, once matched, is never given back).
#: Two loops over the same fields on either side of an optional one (what this was) let a line
#: that fails at its end be split between them in every way: 5 s for a 28 KB line, minutes for 140 KB.
SGLANG_RETRACT = re.compile(
    rf"""
    (?:KV\ cache\ pool\ is\ full\.\ Retract\ requests\.|Decode\ out\ of\ memory\ happened\.)\ 
    \#retracted_reqs:\ (?P<retracted>\d+)
    (?:,\ \#(?:new_token_ratio:\ {_U}\ ->\ (?P<new_ratio>{_U})|\w+:\ \d+))*+
    ,?\ ?$
    """,
    re.X,
)

VLLM_V1 = re.compile(
    rf"""
    (?:Engine\ (?P<engine>\d+):\ |(?P<aggregated>\d+)\ Engines\ Aggregated:\ )?
    Avg\ prompt\ throughput:\ {_U}\ tokens/s,\ 
    Avg\ generation\ throughput:\ {_U}\ tokens/s,\ 
    Running:\ (?P<running>\d+)\ reqs,\ 
    Waiting:\ (?P<waiting>\d+)\ reqs,\ 
    (?:Deferred:\ (?P<deferred>\d+)\ reqs,\ )?
    (?:(?!Preemptions:|[A-Z]+\ KV\ cache\ usage:)[^,]+,\ )*?
    (?:Preemptions:\ (?P<preemptions>\d+),\ )?
    (?P<device>[A-Z]+)\ KV\ cache\ usage:\ (?P<usage>{_U})%
    (?:,\ Prefix\ cache\ hit\ rate:\ (?P<hit>{_U})%)?
    (?:,\ (?!Prefix\ cache\ hit\ rate:)[^,:]+:\ [^,]+)*
    $
    """,
    re.X,
)

VLLM_V0 = re.compile(
    rf"""
    Avg\ prompt\ throughput:\ {_U}\ tokens/s,\ 
    Avg\ generation\ throughput:\ {_U}\ tokens/s,\ 
    Running:\ (?P<running>\d+)\ reqs,\ 
    Swapped:\ (?P<swapped>\d+)\ reqs,\ 
    Pending:\ (?P<waiting>\d+)\ reqs,\ 
    (?P<device>[A-Z]+)\ KV\ cache\ usage:\ (?P<usage>{_U})%,\ 
    CPU\ KV\ cache\ usage:\ {_U}%\.?$
    """,
    re.X,
)

VLLM_V0_HIT = re.compile(rf"Prefix cache hit rate: GPU: (?P<hit>{_U})%, CPU: {_U}%$")

VLLM_V0_PREEMPT = re.compile(
    r"Sequence group \S+ is preempted by PreemptionMode\.\w+ mode because there is not enough KV cache "
    r"space\..*total_num_cumulative_preemption=(?P<total>\d+)$"
)


#: vLLM's version, as it logs it at start-up: the engine core's ``Initializing a V1 LLM engine (vX)``
#: line, the API server's ``vLLM (API) server version X`` line, or the logo (0.30+, the default).
VLLM_VERSION = re.compile(
    r"(?:Initializing a V1 LLM engine \(v|vLLM (?:API )?server version |.*█ ▀▄▀ █\s+version\s+)"
    r"(?P<version>\d+\.\d+(?:\.\d+)?[\w.+-]*)"
)

#: The ``Preemptions: N`` field of vLLM V1's periodic stats line, read off
#: ``vllm/v1/metrics/loggers.py`` in the wheels of every x.y.0 release from 0.8.0 to 0.32.0, 0.11.1,
#: 0.11.2 and 0.33.0: releases up to 0.11.0 have no such field; 0.11.1 added it, printed when the
#: interval's count is > 0, but ``LoggingStatLogger.log()`` first calls ``_update_stats()``, whose
#: ``_reset()`` sets ``num_preemptions = 0``, so no release up to 0.33.0 ever prints it, even
#: while the engine preempts. A log of these versions cannot carry the preemption count.
VLLM_PREEMPTIONS_ADDED = (0, 11, 1)
VLLM_PREEMPTIONS_NEVER_PRINTED_THROUGH = (0, 33, 0)


def vllm_preemptions_field(version: str | None) -> str:
    """What vLLM ``version``'s stats line does with ``Preemptions``: ``"none"`` (it has no such
    field), ``"never printed"`` (it has one, reset before formatting), or ``"unknown"`` (no
    version, or one newer than the releases read)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if m is None:
        return "unknown"
    release = (int(m[1]), int(m[2]), int(m[3] or 0))
    if release < VLLM_PREEMPTIONS_ADDED:
        return "none"
    return "never printed" if release <= VLLM_PREEMPTIONS_NEVER_PRINTED_THROUGH else "unknown"


@dataclass(frozen=True)
class LineFormat:
    """One message format: its engine, its name in reports and provenance, its grammar(s)."""

    key: str
    engine: str
    title: str
    grammars: tuple[re.Pattern[str], ...]
    stats: bool = True  # False for a line that only tells how to read the others (the version)


FORMATS: dict[str, LineFormat] = {
    f.key: f
    for f in (
        LineFormat("sglang_decode", "sglang", "SGLang 'Decode batch' line", (SGLANG_DECODE,)),
        LineFormat("sglang_prefill", "sglang", "SGLang 'Prefill batch' line", (SGLANG_PREFILL,)),
        LineFormat("sglang_retract", "sglang", "SGLang retract warning", (SGLANG_RETRACT,)),
        LineFormat("vllm_stats", "vllm", "vLLM periodic stats line", (VLLM_V1, VLLM_V0)),
        LineFormat("vllm_v0_hit", "vllm", "vLLM V0 prefix-cache hit-rate line", (VLLM_V0_HIT,)),
        LineFormat("vllm_v0_preempt", "vllm", "vLLM V0 preemption warning", (VLLM_V0_PREEMPT,)),
        LineFormat("vllm_version", "vllm", "vLLM start-up version line", (VLLM_VERSION,), stats=False),
    )
}


@dataclass(frozen=True, slots=True)
class LogLine:
    """One engine line taken apart. ``fields`` is None when the message looked like ``fmt``
    but did not match its grammar (``reason`` then says why)."""

    fmt: LineFormat
    fields: dict[str, str] | None
    grammar: re.Pattern[str] | None  # the grammar that matched
    stamp: str | None  # the timestamp text chosen (see ``stamp_kind``)
    stamp_kind: str  # "zoned" (carries its zone), "ymd" (no zone) or "md" (no zone, no year)
    ranks: dict[str, int]  # SGLang rank tags, e.g. {"DP": 1, "TP": 0}
    source: str | None  # the collector's name for the emitter (pod, compose service, host/ident)
    origin: str | None  # vLLM's "file.py:line" of the logging call
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Mention:
    """A line that names an engine stats marker (``Decode batch``, ``Avg prompt throughput:``)
    but holds no engine line kvdiag reads: a prompt quoting one, or a wrapper it does not know.
    Skipped, but counted: a log with only these warns (see ``logs.LogReport``)."""

    marker: str


def parse(raw: str) -> LogLine | Mention | None:
    """The engine line in ``raw``; a Mention when it names a stats marker but is no engine line;
    None when it is not about engine stats at all."""
    marker = MARKERS.search(raw)
    if marker is None:
        return None
    skipped = None if marker[0] in VERSION_MARKERS else Mention(marker[0])
    text = ANSI.sub("", raw) if "\x1b" in raw else raw
    text = text.rstrip("\r\n")
    col = COLLECTOR.match(text)
    rest = text[col.end() :]
    source = col["k8s"] or col["compose"] or (f"{col['host']}/{col['ident']}" if col["ident"] else None)
    zoned = col["rfc"] or col["jiso"]
    head = SGLANG_HEAD.match(rest) if rest.startswith("[") else VLLM_HEAD.match(rest)
    if head is None:
        kind = KIND.match(rest)
        if kind is None:
            return skipped
        if kind.lastgroup == "vllm_version":
            return None  # the version is only a hint: nothing to count
        return LogLine(FORMATS[kind.lastgroup or ""], None, None, zoned, "zoned", {}, source, None,
                       "no engine log prefix (timestamp) before the message")
    message = rest[head.end() :]
    kind = KIND.match(message)
    if kind is None:
        return skipped
    fmt = FORMATS[kind.lastgroup or ""]
    groups = head.groupdict()
    ranks = {tag: int(n) for tag, n in RANK.findall(groups["ranks"])} if "ranks" in groups else {}
    if zoned:
        stamp, stamp_kind = zoned, "zoned"
    elif "ymd" in groups:
        stamp, stamp_kind = groups["ymd"], "ymd"
    else:
        stamp, stamp_kind = groups["md"], "md"
    origin = groups.get("src")
    for grammar in fmt.grammars:
        m = grammar.match(message)
        if m is not None:
            return LogLine(fmt, m.groupdict(), grammar, stamp, stamp_kind, ranks, source, origin)
    if fmt.key == "vllm_version":
        return None
    return LogLine(fmt, None, None, stamp, stamp_kind, ranks, source, origin,
                   f"does not match the {fmt.title} grammar (truncated, or a variant kvdiag does not know)")
