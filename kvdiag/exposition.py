"""A targeted reader of the Prometheus text format 0.0.4 and OpenMetrics 1.0.

kvdiag reads thousands of engine expositions a minute, and each is 60-100 KB of which it
needs a few dozen families. So the reader is told up front which families it wants, finds
their lines with one compiled pattern (the regex engine skips everything else at C speed),
and builds samples only for those. Everything it does build is checked strictly: a line it
cannot read exactly is an ``ExpositionError`` naming the line, never a guess.

Format facts it handles (see shared/facts/engine-metrics.md):
- 0.0.4 types a counter under its ``_total`` name and ``_created`` as a separate gauge family;
  OpenMetrics types it under the bare family name and ends the body with ``# EOF``.
- prometheus_client >= 0.23 answers a scraper that asks for OpenMetrics without an
  ``escaping=`` parameter with underscore-escaped sample names (``sglang_token_usage``) while
  the ``# TYPE`` lines keep the colon. A wanted ``a:b`` family therefore also matches ``a_b``.
- Values may be ``NaN``/``+Inf``/``-Inf``; label values may hold escaped quotes, backslashes
  and newlines, commas, braces and ``#``; labels come in any order; multiprocess output lists
  families in mmap-file order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable

#: Bodies above this size are refused before any work is done (engines serve ~60-100 KB).
DEFAULT_MAX_BYTES = 16 * 1024 * 1024

#: Sample-name suffixes read for a wanted family. ``_created`` samples are skipped unbuilt:
#: kvdiag detects restarts from counter decreases, which every registry mode shows.
SUFFIXES = ("_total", "_bucket", "_sum", "_count")

_QUOTED = r'[^"\\\n]*(?:\\.[^"\\\n]*)*'  # a label value, escapes unrolled for speed
_PAIR = r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"(' + _QUOTED + r')"[ \t]*'
_PAIR_NC = r'[ \t]*[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"' + _QUOTED + r'"[ \t]*'
_PAIR_RE = re.compile(_PAIR)
# Everything after the name of a sample line; a wanted line that does not fit is "bad".
_REST = (
    r"(?:(?:\{(" + r"(?:" + _PAIR_NC + r",)*(?:" + _PAIR_NC + r")?" + r")\})?"  # labels
    r"[ \t]+([^ \t#\n]+)"  # value
    r"(?:[ \t]+([^ \t#\n]+))?"  # timestamp
    r"[ \t]*(?:#[ \t]*(\{[^\n]*))?(?=\n|\Z)"  # exemplar
    r"|([{ \t][^\n]*))"  # anything else: malformed
)
_NO_LABELS: dict[str, str] = {}
_LABEL_CACHE_MAX = 200_000
_ESCAPE_RE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


class ExpositionError(ValueError):
    """The body cannot be read exactly. Carries the 1-based line number and the line."""

    def __init__(self, reason: str, lineno: int | None = None, line: str | None = None) -> None:
        self.reason = reason
        self.lineno = lineno
        self.line = line
        where = ""
        if lineno is not None:
            shown = line if line is None or len(line) <= 160 else line[:157] + "..."
            where = f" at line {lineno}: {shown!r}"
        super().__init__(f"{reason}{where}")


@dataclass(slots=True)
class Sample:
    """One sample line of a wanted family."""

    suffix: str  # "" or one of SUFFIXES
    labels: dict[str, str]  # shared with other samples of the same label string: do not mutate
    value: float
    timestamp: float | None  # as written: ms in 0.0.4, seconds in OpenMetrics
    offset: int  # where the line starts in the body; lineno_at() turns it into a line number


@dataclass
class Family:
    """The samples of one wanted family, under the name kvdiag asked for."""

    name: str
    type: str | None = None  # from a # TYPE line under the family, _total or escaped name
    samples: list[Sample] = field(default_factory=list)
    escaped: bool = False  # sample names came underscore-escaped (a:b written a_b)
    #: Samples grouped by label values, built on first use by the engine adapters
    #: (``engines.base``) so that reading N instances of one server costs O(samples).
    groups: dict = field(default_factory=dict, repr=False, compare=False)

    def series(self, suffix: str = "") -> list[Sample]:
        return [s for s in self.samples if s.suffix == suffix]


@dataclass
class Exposition:
    """What the reader returns: the wanted families that are present, and the format."""

    families: dict[str, Family]
    openmetrics: bool
    size: int

    def get(self, name: str) -> Family | None:
        return self.families.get(name)


def _escaped(name: str) -> str:
    return name.replace(":", "_")


class Reader:
    """Compiled once for a set of wanted family names; ``read`` is then called per body."""

    def __init__(self, wanted: Iterable[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.wanted = sorted(set(wanted))
        # Every spelling a sample or TYPE line of a wanted family may use, to its family.
        spellings: dict[str, tuple[str, bool]] = {}
        for fam in self.wanted:
            spellings[fam] = (fam, False)
            if ":" in fam:
                spellings.setdefault(_escaped(fam), (fam, True))
        # Every sample name, to (family, suffix, escaped); the bare name wins over a suffix.
        self._resolve: dict[str, tuple[str, str, bool]] = {}
        for suffix in SUFFIXES + ("",):
            for spelling, (fam, esc) in spellings.items():
                self._resolve[spelling + suffix] = (fam, suffix, esc)
        names = _trie_pattern(list(spellings))
        suffixes = "|".join(SUFFIXES)
        self._line_re = re.compile(r"\n(" + names + r"(?:" + suffixes + r")?)(?=[{ \t])" + _REST)
        # Label strings repeat from one scrape of a target to the next; parsing each once
        # makes the steady-state read of a fleet cheap. The dicts are shared: read-only.
        self._labels: dict[str, dict[str, str]] = {}
        self._type_re = re.compile(r"\n# TYPE[ \t]+(" + names + r"(?:_total|_info)?)[ \t]+([a-z]+)[ \t]*(?=\n|$)")

    def read(self, body: bytes | str, content_type: str | None = None) -> Exposition:
        """Parse ``body`` and return the wanted families found in it."""
        if isinstance(body, bytes):
            if len(body) > self.max_bytes:
                raise ExpositionError(f"body of {len(body)} bytes exceeds the {self.max_bytes}-byte cap")
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ExpositionError(f"body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        else:
            text = body
            if len(text) > self.max_bytes:
                raise ExpositionError(f"body of {len(text)} characters exceeds the {self.max_bytes}-byte cap")
        openmetrics = _is_openmetrics(text, content_type)
        if openmetrics:
            _check_eof(text)
        scan = "\n" + text
        families: dict[str, Family] = {}
        types: dict[str, str] = {}
        for m in self._type_re.finditer(scan):
            types[m.group(1)] = m.group(2)
        resolve = self._resolve
        cache = self._labels
        if len(cache) > _LABEL_CACHE_MAX:
            cache.clear()
        for m in self._line_re.finditer(scan):
            name, raw_labels, raw_value, raw_ts, exemplar, bad = m.groups()
            offset = m.start()  # the newline before the line in the scan: the line's offset in text
            if bad is not None:
                raise ExpositionError("malformed sample line", lineno_at(text, offset), m.group(0)[1:])
            if m.end() == len(scan) and not openmetrics and not text.endswith("\n"):
                raise ExpositionError("last line has no newline; the body looks truncated", lineno_at(text, offset), m.group(0)[1:])
            fam_name, suffix, escaped = resolve[name]
            fam = families.get(fam_name)
            if fam is None:
                fam = families[fam_name] = Family(fam_name, _family_type(fam_name, types), escaped=escaped)
            if exemplar is not None and not openmetrics:
                raise ExpositionError("exemplars are only allowed in OpenMetrics", lineno_at(text, offset), m.group(0)[1:])
            labels = cache.get(raw_labels) if raw_labels else _NO_LABELS
            if labels is None:
                labels = cache[raw_labels] = _labels(raw_labels, text, offset)
            value = _parse_float(raw_value, text, offset)
            timestamp = None if raw_ts is None else _timestamp(raw_ts, text, offset)
            fam.samples.append(Sample(suffix, labels, value, timestamp, offset))
        for fam in families.values():
            _check_duplicates(fam, text)
        return Exposition(families, openmetrics, len(text))


def _family_type(fam: str, types: dict[str, str]) -> str | None:
    for spelling in (fam, fam + "_total", fam + "_info", _escaped(fam), _escaped(fam) + "_total"):
        if spelling in types:
            return types[spelling]
    return None


def _is_openmetrics(text: str, content_type: str | None) -> bool:
    """OpenMetrics when the server says so, or when the body ends with the ``# EOF`` line."""
    if content_type and "application/openmetrics-text" in content_type.lower():
        return True
    tail = text.rstrip("\n")
    return tail == "# EOF" or tail.endswith("\n# EOF")


def _check_eof(text: str) -> None:
    stripped = text.rstrip("\n")
    if not stripped.endswith("# EOF"):
        raise ExpositionError("OpenMetrics body does not end with '# EOF'; the body looks truncated")
    if stripped[:-5].rfind("\n# EOF") != -1 or stripped.startswith("# EOF\n"):
        raise ExpositionError("OpenMetrics body has content after '# EOF'")


def lineno_at(text: str, offset: int) -> int:
    """1-based number of the line starting at ``offset``; computed only when it is needed."""
    return text.count("\n", 0, offset) + 1


def _trie_pattern(words: list[str]) -> str:
    """A regex alternation shaped as a trie, so a non-matching line fails at its first chars
    instead of being tried against every wanted name in turn."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> str:
        ends = "" in node
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return "(?:" + body + ")?" if ends else body

    return "(?:" + emit(trie) + ")"


def _line(text: str, offset: int) -> str:
    end = text.find("\n", offset)
    return text[offset : end if end != -1 else len(text)]


def _labels(raw: str, text: str, offset: int) -> dict[str, str]:
    pairs = _PAIR_RE.findall(raw)
    labels = dict(pairs)
    if len(labels) != len(pairs):
        raise ExpositionError("a label is given twice", lineno_at(text, offset), _line(text, offset))
    if "\\" in raw:
        labels = {k: _ESCAPE_RE.sub(_unescape, v) for k, v in labels.items()}
    return labels


def _timestamp(raw: str, text: str, offset: int) -> float:
    ts = _parse_float(raw, text, offset)
    if not math.isfinite(ts):
        raise ExpositionError("timestamp is not finite", lineno_at(text, offset), _line(text, offset))
    return ts


def _unescape(m: re.Match[str]) -> str:
    return _ESCAPES.get(m.group(1), "\\" + m.group(1))


def _parse_float(raw: str, text: str, offset: int) -> float:
    """Go's ParseFloat, as Prometheus uses it: Python's float() less digit separators."""
    if "_" not in raw:
        try:
            return float(raw)
        except ValueError:
            pass
    raise ExpositionError(f"value {raw!r} is not a number", lineno_at(text, offset), _line(text, offset))


def _check_duplicates(fam: Family, text: str) -> None:
    """Two samples with one name and label set: Prometheus rejects the scrape, and so do we,
    since which of the two values is right cannot be known."""
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for s in fam.samples:
        key = (s.suffix, frozenset(s.labels.items()))
        if key in seen:
            raise ExpositionError(f"duplicate series in family {fam.name}", lineno_at(text, s.offset), _line(text, s.offset))
        seen.add(key)


def scan_prefixes(body: bytes | str, limit: int = 8) -> list[str]:
    """A few distinct metric-name prefixes in a body, for 'unknown engine' explanations.

    Only used on the slow path, when no wanted family was found.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    seen: dict[str, None] = {}
    for line in text.split("\n"):
        if not line or line[0] == "#":
            continue
        name = re.split(r"[{ \t]", line, maxsplit=1)[0]
        prefix = re.split(r"[:_]", name, maxsplit=1)[0] if name else ""
        if prefix and prefix not in seen:
            seen[prefix] = None
            if len(seen) >= limit:
                break
    return list(seen)
