"""The checklist's thresholds, windows and SLO: one YAML section, CLI overrides on top.

Every number a check compares against lives here, with its default, so that `kvdiag explain`,
the CLI, the exporter and the generated Prometheus rules all read the same values. The YAML
file is shared with other commands (`kvdiag serve` keeps its targets in it): the thresholds
sit under a top-level ``checks:`` key, e.g.::

    checks:
      window: 5m
      saturated_usage: 0.95
      ttft_slo: 10s

A bad key or value is refused with the file, line and key at fault, never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable

import yaml

from kvdiag.quantity import CHECK_DURATION, parse_duration  # noqa: F401 (parse_duration: read from here by the commands)

SECTION = "checks"
#: Deepest nesting a config may have (kvdiag's own goes 4 levels deep); deeper is refused
#: before PyYAML's recursive composer can exhaust the stack.
MAX_DEPTH = 16



class ConfigError(ValueError):
    """A configuration the checks cannot run with; the message names where and why."""


def _opt(default: float, kind: str, doc: str) -> Any:
    """A config field: ``kind`` is duration | ratio | count | number (how it is parsed/checked)."""
    return field(default=default, metadata={"kind": kind, "doc": doc})


@dataclass(frozen=True)
class Config:
    """Thresholds of the checklist (defaults from the issue; durations in seconds)."""

    window: float = _opt(300.0, "duration", "span the checks look back over, ending at the newest sample")
    saturated_usage: float = _opt(0.95, "ratio", "kv_usage_saturated: active KV usage counted as 'near 1'")
    saturated_fraction: float = _opt(0.8, "ratio", "kv_usage_saturated (long window): share of the window's usage samples that, with the next admission's need, reach saturated_usage")
    saturated_short_window: float = _opt(20.0, "duration", "kv_usage_saturated (short window): pinned at every sample of this span fires at once")
    high_usage: float = _opt(0.7, "ratio", "queue_without_kv_pressure: usage this high without being pinned is named in the evidence")
    queue_short_window: float = _opt(60.0, "duration", "queue_growing (short window): the span the queue's rise is measured over")
    queue_min_growth: float = _opt(5, "count", "queue_growing: the absolute floor, in requests, of a rise (and of a backlog) that means something")
    queue_growth_ratio: float = _opt(0.05, "number", "queue_growing: a rise must also reach this share of the running batch")
    backlog_ratio: float = _opt(1.0, "number", "queue_growing: a backlog of waiting >= backlog_ratio x running (and >= queue_min_growth) not draining over the short window also fires")
    min_samples: float = _opt(3, "count", "growth checks need at least this many samples in the window")
    min_evictions: float = _opt(1, "count", "evictions_growing: retract/preempt increase over the recent span that fires")
    evictions_recent_window: float = _opt(60.0, "duration", "evictions_growing: the recent span whose evictions fire (an eviction older than this, still in the window, is evidence only: it proves the pool ran out then, not that it limits now, unless the pool stayed full since)")
    evictions_held_usage: float = _opt(0.85, "ratio", "evictions_growing: an eviction in the window but before evictions_recent_window still fires while usage + the next admission's need reached this at every sample of that recent span (the pool that ran out is still that full)")
    evictions_storm: float = _opt(10, "count", "kv_usage_saturated (storm): this many retract/preempt events over evictions_recent_window, with queue_min_growth or more requests waiting (the most over saturated_short_window), prove the pool runs out again and again whatever the usage gauge reads between them")
    ttft_slo: float = _opt(10.0, "duration", "ttft_p99_high: the TTFT SLO the quantile is compared with")
    ttft_quantile: float = _opt(0.99, "ratio", "ttft_p99_high: the quantile estimated from the TTFT histogram")
    min_ttft_observations: float = _opt(10, "count", "ttft_p99_high: first tokens needed in the window for a quantile (traffic floor)")
    prefix_hit_high: float = _opt(0.5, "ratio", "prefix_hit_high: prefix-cache hit ratio (hit tokens / queried tokens) that counts as high")
    l2_low_occupancy: float = _opt(0.5, "ratio", "l2_underused: L2 occupancy below this means L2 has room")
    l2_low_hit_share: float = _opt(0.1, "ratio", "l2_underused: L2 hits below this share of prompt tokens means L2 barely helps")

    def describe(self) -> list[tuple[str, str, str]]:
        """(key, value as written in YAML, what it does) for every threshold, in order."""
        return [(f.name, format_value(getattr(self, f.name), f.metadata["kind"]), f.metadata["doc"]) for f in fields(self)]

    def promql_params(self) -> dict[str, str]:
        """The thresholds as PromQL literals for the catalog's expression templates: durations
        as range literals (``5m``) and, under ``<key>_seconds``, as numbers."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = format_value(v, f.metadata["kind"])
            if f.metadata["kind"] == "duration":
                out[f.name + "_seconds"] = format_value(v, "number")
        out["saturated_quantile"] = format_value(1 - self.saturated_fraction, "number")
        return out


KEYS = {f.name: f for f in fields(Config)}


def prom_duration(seconds: float) -> str:
    """Seconds as a Prometheus duration literal: the largest unit that divides it exactly."""
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and float(seconds) % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{int(round(seconds * 1000))}ms"


def format_value(v: float, kind: str) -> str:
    if kind == "duration":
        return prom_duration(v)
    if kind == "count":
        return str(int(v))
    return f"{v:g}"


def parse_value(key: str, raw: Any) -> float:
    """One value for ``key``, parsed and range-checked; ValueError says what is wrong."""
    if key not in KEYS:
        raise KeyError(f"unknown threshold {key!r}; known: {', '.join(KEYS)}")
    kind = KEYS[key].metadata["kind"]
    if kind == "duration":
        return replace(CHECK_DURATION, what=key).parse(raw)
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"{raw!r} is not a number")
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not a number") from None
    if not math.isfinite(v):
        raise ValueError(f"{raw!r} is not a finite number")
    if kind == "ratio" and not 0.0 <= v <= 1.0:
        raise ValueError(f"{v:g} is not a ratio between 0 and 1")
    if kind == "count" and (v < 0 or v != int(v)):
        raise ValueError(f"{v:g} is not a whole number >= 0")
    return v


def from_mapping(data: dict[str, Any], where: dict[str, str] | None = None, base: Config | None = None) -> Config:
    """A Config from a plain mapping; ``where`` maps keys to 'file:line' for error messages."""
    where = where or {}
    values = {}
    for key, raw in data.items():
        loc = where.get(key, "")
        prefix = f"{loc}: " if loc else ""
        try:
            values[key] = parse_value(str(key), raw)
        except KeyError as exc:
            raise ConfigError(f"{prefix}{SECTION}.{key}: {exc.args[0]}") from None
        except ValueError as exc:
            raise ConfigError(f"{prefix}{SECTION}.{key}: {exc}") from None
    return replace(base or Config(), **values)


def load(path: str | Path) -> Config:
    """Read the ``checks:`` section of a YAML file (other top-level sections belong to other
    commands and are left to them)."""
    path = Path(path)
    root = read_yaml(path)
    if root is None:
        return Config()
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}:{root.start_mark.line + 1}: the file must be a mapping with a '{SECTION}:' section")
    for key_node, _ in root.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: keys must be plain names")
        if key_node.value in KEYS:
            raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: {key_node.value!r} belongs under '{SECTION}:'")
    section = next((v for k, v in root.value if k.value == SECTION), None)
    if section is None:
        return Config()
    if not isinstance(section, yaml.MappingNode):
        raise ConfigError(f"{path}:{section.start_mark.line + 1}: '{SECTION}' must be a mapping of threshold: value")
    data: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key_node, value_node in section.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: keys must be plain names")
        key = key_node.value
        if key in data:
            raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: {SECTION}.{key} is given twice")
        where[key] = f"{path}:{key_node.start_mark.line + 1}"
        if not isinstance(value_node, yaml.ScalarNode):
            raise ConfigError(f"{where[key]}: {SECTION}.{key}: expected a single value")
        data[key] = value_of(value_node, path)
    return from_mapping(data, where)


def value_of(node: yaml.Node, path: Path | None = None) -> Any:
    """The Python value of a composed node (an empty ``key:`` is None), without re-parsing;
    ConfigError (with the line) for a scalar that looks like a value it is not (2026-13-45)."""
    try:
        return yaml.SafeLoader("").construct_document(node)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:
        where = f"{path}:{node.start_mark.line + 1}" if path is not None else f"line {node.start_mark.line + 1}"
        raise ConfigError(f"{where}: {getattr(exc, 'problem', None) or exc}") from None


def read_yaml(path: Path) -> yaml.Node | None:
    """The file's YAML node tree; ConfigError (file and line) for an unreadable file, bytes
    that are not UTF-8, YAML that does not parse, or nesting deeper than MAX_DEPTH."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    deep = _too_deep(text)
    if deep is not None:
        raise ConfigError(f"{path}:{deep}: nested more than {MAX_DEPTH} levels deep")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if root is not None:
        _check_plain(root, path)
    return root


#: The node tags a config may hold: what plain YAML resolves to by itself.
PLAIN_TAGS = frozenset("tag:yaml.org,2002:" + t for t in ("str", "int", "float", "bool", "null", "timestamp", "map", "seq"))


def _check_plain(root: yaml.Node, path: Path) -> None:
    """Refuse, with the line, what no section of kvdiag's config means and what would escape
    the sections' own checks: an explicit tag (``!custom``, ``!!python/name:...``, which the
    safe loader cannot construct: a traceback, not an error), a list or mapping used as a key,
    a key given twice in any mapping (YAML keeps the last silently). Iterative, and each node
    once (an alias shares its anchor's node)."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    seen: set[int] = set()
    while stack:
        node, at = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        where = f"{path}:{node.start_mark.line + 1}"
        if node.tag not in PLAIN_TAGS:
            raise ConfigError(f"{where}: the YAML tag {node.tag!r} is not allowed here (a config holds plain strings, numbers, booleans, lists and mappings)")
        if isinstance(node, yaml.MappingNode):
            keys: set[str] = set()
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode):
                    kind = "list" if isinstance(key, yaml.SequenceNode) else "mapping"
                    raise ConfigError(f"{path}:{key.start_mark.line + 1}: {at + '.' if at else ''}<{kind}>: a key must be a plain name, not a {kind}")
                name = f"{at}.{key.value}" if at else key.value
                if key.value in keys:
                    raise ConfigError(f"{path}:{key.start_mark.line + 1}: {name} is given twice")
                keys.add(key.value)
                stack.extend(((key, name), (value, name)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(node.value))


def _too_deep(text: str) -> int | None:
    """The line where the YAML first nests past MAX_DEPTH (by scanning its events, which is
    iterative, where composing is recursive); None when it does not, or does not parse."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    return event.start_mark.line + 1
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        return None  # compose reports it, with its line
    return None


def with_overrides(config: Config, assignments: Iterable[str]) -> Config:
    """Apply ``key=value`` overrides from the command line (later ones win)."""
    data: dict[str, Any] = {}
    where: dict[str, str] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        key = key.strip().replace("-", "_")
        data[key] = raw.strip()
        where[key] = f"--set {item}"
    return from_mapping(data, where, base=config)


def resolve(path: str | None, assignments: Iterable[str] = ()) -> Config:
    """The config in force: defaults, then the file, then the command line."""
    return with_overrides(load(path) if path else Config(), assignments)
