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
- Prometheus 3 negotiates ``escaping=`` (``underscores``, ``dots``, ``values``,
  ``allow-utf-8``). prometheus_client 0.26 escapes OpenMetrics sample names with the label
  character set (no colon): ``sglang_token_usage``, ``sglang__token__usage`` (dots, label names
  ``tp__rank`` too), ``U__sglang_3a_token__usage`` (values); the text format and Go writers keep
  the colon (``sglang:token__usage`` under dots). Every spelling of a wanted name is read.
  UTF-8 names may be quoted inside the braces: ``{"sglang:num_running_reqs",tp_rank="0"} 3``.
- Values may be ``NaN``/``+Inf``/``-Inf``; label values may hold escaped quotes, backslashes
  and newlines, commas, braces and ``#``; labels come in any order; multiprocess output lists
  families in mmap-file order. A number beyond float range (``1e400``, a 401-digit integer)
  is refused, as Go's ParseFloat refuses it, never read as infinity.
- The text format's last line ends with a newline: a body that does not is cut, and refused.
  Leading blanks on a line are ignored (the format says so; Prometheus skips them), but
  refused in OpenMetrics, whose grammar has none; a UTF-8 byte-order mark is dropped.
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
# A label name is legacy (``tp_rank``) or quoted (``"gpu.id"``, Prometheus 3 UTF-8 names).
_PAIR = r'[ \t]*(?:([a-zA-Z_][a-zA-Z0-9_]*)|"(' + _QUOTED + r')")[ \t]*=[ \t]*"(' + _QUOTED + r')"[ \t]*'
_PAIR_NC = r'[ \t]*(?:[a-zA-Z_][a-zA-Z0-9_]*|"' + _QUOTED + r'")[ \t]*=[ \t]*"' + _QUOTED + r'"[ \t]*'
_PAIR_RE = re.compile(_PAIR)
_LABELS = r"(?:" + _PAIR_NC + r",)*(?:" + _PAIR_NC + r")?"
_TAIL = (
    r"[ \t]+([^ \t#\n]+)"  # value
    r"(?:[ \t]+([^ \t#\n]+))?"  # timestamp
    r"[ \t]*(?:#[ \t]*(\{[^\n]*))?(?=\n|\Z)"  # exemplar
)
# Everything after the name of a sample line; a wanted line that does not fit is "bad".
_REST = r"(?:(?:\{(" + _LABELS + r")\})?" + _TAIL + r"|([{ \t][^\n]*))"
# The same after a quoted name inside the braces: ``{"name"`` then ``,labels}`` or ``}``.
_QUOTED_REST = r'"[ \t]*(?:(?:,(' + _LABELS + r"))?\}" + _TAIL + r"|([^\n]*))"
_NO_LABELS: dict[str, str] = {}
_LABEL_CACHE_MAX = 200_000
_ESCAPE_RE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}
_INFINITIES = (math.inf, -math.inf)


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


#: Escaping schemes, as Prometheus 3 negotiates them ("" = the name as written).
SCHEMES = ("", "underscores", "dots", "values")


def _legacy_rune(ch: str, i: int, colon: bool) -> bool:
    return ch.isascii() and (ch.isalpha() or ch == "_" or (ch.isdigit() and i > 0) or (colon and ch == ":"))


def _dots(name: str, colon: bool) -> str:
    """prometheus/common's dots escaping (``_`` -> ``__``, ``.`` -> ``_dot_``, others -> ``__``)."""
    out = []
    for i, ch in enumerate(name):
        out.append("__" if ch == "_" else "_dot_" if ch == "." else ch if _legacy_rune(ch, i, colon) else "__")
    return "".join(out)


def _values(name: str) -> str:
    """prometheus_client's OpenMetrics value escaping of a sample name: ``U__``, ``_`` -> ``__``,
    and every character outside the label set (the colon too) as ``_<hex code>_``."""
    out = ["U__"]
    for i, ch in enumerate(name):
        out.append("__" if ch == "_" else ch if _legacy_rune(ch, i, False) else f"_{ord(ch):x}_")
    return "".join(out)


def spellings(name: str) -> dict[str, str]:
    """Every way a writer may spell the sample or TYPE name ``name``, to its scheme.

    Text writers and Go keep the colon; prometheus_client's OpenMetrics writer escapes sample
    names with the label character set, so both forms of each scheme are listed.
    """
    out = {name: ""}
    for spelling, scheme in (
        (name.replace(":", "_"), "underscores"),
        (_dots(name, colon=True), "dots"),
        (_dots(name, colon=False), "dots"),
        (_values(name), "values"),
    ):
        out.setdefault(spelling, scheme)
    return out


def sample_names(wanted: Iterable[str], suffixes: tuple[str, ...] = ("",) + SUFFIXES) -> dict[str, tuple[str, str, str]]:
    """Every spelling of every sample name of the wanted families, to (family, suffix,
    scheme). A name as written wins over an escaped spelling that happens to equal it, and a
    family's bare name over another's suffixed one."""
    out: dict[str, tuple[str, str, str]] = {}
    for pass_schemes in (("",), SCHEMES[1:]):
        for fam in wanted:
            for suffix in suffixes:
                for spelling, scheme in spellings(fam + suffix).items():
                    if scheme in pass_schemes:
                        out.setdefault(spelling, (fam, suffix, scheme))
    return out


def _undots(name: str) -> str:
    """A label name back from dots escaping (exact for the legacy names kvdiag reads)."""
    return name.replace("_dot_", ".").replace("__", "_")


class Reader:
    """Compiled once for a set of wanted family names; ``read`` is then called per body."""

    def __init__(self, wanted: Iterable[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.wanted = sorted(set(wanted))
        # Every sample name (each suffix, each escaping scheme) to (family, suffix, scheme).
        self._resolve = sample_names(self.wanted)
        self._names = _trie_pattern(list(self._resolve))
        # ``name{labels} v`` (groups 1-6). Compiling the names' trie is most of a CLI's
        # start-up, so the pattern that also finds the quoted form is compiled on first need.
        self._plain_re = re.compile(r"\n[ \t]*(" + self._names + r")(?=[{ \t])" + _REST)
        self._both_re: re.Pattern[str] | None = None
        # Label strings repeat from one scrape of a target to the next; parsing each once
        # makes the steady-state read of a fleet cheap. The dicts are shared: read-only.
        self._labels: dict[str, dict[str, str]] = {}
        self._types = sample_names(self.wanted, ("", "_total", "_info"))
        type_names = _trie_pattern(list(self._types))
        self._type_re = re.compile(r'\n[ \t]*#[ \t]*TYPE[ \t]+("?)(' + type_names + r')\1[ \t]+([a-z]+)[ \t]*(?=\n|$)')

    def _line_pattern(self, scan: str) -> re.Pattern[str]:
        """The sample-line pattern for this body: one pass finds ``name{labels} v`` (groups
        1-6) and, where the body may hold it, ``{"name",labels} v`` (7-12). A quoted name needs
        ``{"``; a body without it is read by the plain pattern alone."""
        if '{"' not in scan:
            return self._plain_re
        if self._both_re is None:
            names = self._names
            self._both_re = re.compile(
                r"\n[ \t]*(?:(" + names + r")(?=[{ \t])" + _REST + r'|\{[ \t]*"(' + names + r")" + _QUOTED_REST + ")"
            )
        return self._both_re

    def read(self, body: bytes | str, content_type: str | None = None) -> Exposition:
        """Parse ``body`` and return the wanted families found in it."""
        text = self._text(body)
        openmetrics = _is_openmetrics(text, content_type)
        if openmetrics:
            _check_eof(text)
        elif text and not text.endswith("\n"):
            last = text.rfind("\n") + 1
            raise ExpositionError("last line has no newline; the body looks truncated", lineno_at(text, last), text[last:])
        scan = "\n" + text
        families: dict[str, Family] = {}
        types: dict[str, str] = {}
        for m in self._type_re.finditer(scan):
            types.setdefault(self._types[m.group(2)][0], m.group(3))
        resolve = self._resolve
        cache = self._labels
        if len(cache) > _LABEL_CACHE_MAX:
            cache.clear()
        for m in self._line_pattern(scan).finditer(scan):
            groups = m.groups()
            name, raw_labels, raw_value, raw_ts, exemplar, bad = groups[:6] if groups[0] is not None else groups[6:]
            offset = m.start()  # the newline before the line in the scan: the line's offset in text
            if bad is not None:
                raise ExpositionError("malformed sample line", lineno_at(text, offset), _line(text, offset))
            if openmetrics and text[offset : offset + 1] in (" ", "\t"):
                raise ExpositionError("OpenMetrics allows no blank before a sample", lineno_at(text, offset), _line(text, offset))
            fam_name, suffix, scheme = resolve[name]
            fam = families.get(fam_name)
            if fam is None:
                fam = families[fam_name] = Family(fam_name, types.get(fam_name), escaped=scheme != "")
            if exemplar is not None and not openmetrics:
                raise ExpositionError("exemplars are only allowed in OpenMetrics", lineno_at(text, offset), _line(text, offset))
            if not raw_labels:
                labels = _NO_LABELS
            else:
                key = raw_labels if scheme != "dots" else "\x00" + raw_labels
                labels = cache.get(key)  # type: ignore[assignment]
                if labels is None:
                    labels = cache[key] = _labels(raw_labels, text, offset, scheme == "dots")
            value = _parse_float(raw_value, text, offset)
            timestamp = None if raw_ts is None else _timestamp(raw_ts, text, offset)
            fam.samples.append(Sample(suffix, labels, value, timestamp, offset))
        for fam in families.values():
            _check_duplicates(fam, text)
        return Exposition(families, openmetrics, len(text))

    def _text(self, body: bytes | str) -> str:
        """The body as text, under the size cap, without a byte-order mark."""
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
        return text[1:] if text.startswith("\ufeff") else text


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


def _labels(raw: str, text: str, offset: int, dots: bool = False) -> dict[str, str]:
    """The label pairs of one sample; quoted names unescaped, dots-escaped names restored."""
    pairs = [(name or _ESCAPE_RE.sub(_unescape, quoted), v) for name, quoted, v in _PAIR_RE.findall(raw)]
    if dots:
        pairs = [(_undots(k), v) for k, v in pairs]
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
    """Go's ParseFloat, as Prometheus uses it: Python's float() less digit separators and
    non-ASCII digits, and refusing a finite number beyond float range instead of rounding it
    to infinity (Go's ErrRange; Prometheus fails the scrape)."""
    if "_" not in raw and raw.isascii() and raw.strip() == raw:  # float() would skip \r, \v, \f
        try:
            v = float(raw)
        except ValueError:
            pass
        else:
            if v not in _INFINITIES or raw.lstrip("+-")[:1] in "iI":
                return v
            raise ExpositionError(f"value {raw[:40]!r}{'...' if len(raw) > 40 else ''} is beyond float range", lineno_at(text, offset), _line(text, offset))
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


#: The longest prefix ``scan_prefixes`` names.
PREFIX_CHARS = 32
_METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def scan_prefixes(body: bytes | str, limit: int = 8) -> list[str]:
    """A few distinct metric-name prefixes in a body, for 'unknown engine' explanations.

    Only used on the slow path, when no wanted family was found. Only what reads as a metric
    name is named, cut to PREFIX_CHARS: the body of something that is no exporter (what a
    redirect or a misconfigured target answers) is never quoted into an error this way.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    seen: dict[str, None] = {}
    for line in text.split("\n"):
        if not line or line[0] == "#":
            continue
        name = re.split(r"[{ \t]", line, maxsplit=1)[0]
        prefix = re.split(r"[:_]", name, maxsplit=1)[0] if _METRIC_NAME_RE.fullmatch(name) else ""
        prefix = prefix[:PREFIX_CHARS]
        if prefix and prefix not in seen:
            seen[prefix] = None
            if len(seen) >= limit:
                break
    return list(seen)
