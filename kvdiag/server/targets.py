"""Which engines to scrape: static targets, Prometheus ``file_sd`` files, and sharding.

``file_sd`` files use Prometheus' own format (a list of ``{"targets": [...], "labels": {...}}``
groups, JSON or YAML), so whatever already writes them for Prometheus can feed kvdiag. They
are re-read when their modification time changes; a file that is unreadable or malformed
keeps its previous targets (as Prometheus does) and the error is reported, never raised into
the scrape loop. Sharding hashes the target URL with a stable hash (not Python's salted
``hash``), so every exporter of a fleet agrees on who scrapes what, across restarts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from kvdiag.excerpt import excerpt
from kvdiag.sources.urls import InvalidURL, parse, redact, split_userinfo


#: Labels kvdiag's own series carry; a target's extra labels may not reuse them.
RESERVED_LABELS = frozenset({"instance", "engine", "model", "state", "check", "verdict", "version", "target"})
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class TargetsError(ValueError):
    """A target list that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Target:
    """One engine endpoint and the extra labels it is published with. Credentials written
    in the URL (``http://user:pass@host``) are kept apart in ``basic``, so the URL that names
    the target in labels, the API and logs never carries them."""

    url: str
    labels: tuple[tuple[str, str], ...] = ()
    basic: tuple[str, str] | None = field(default=None, repr=False)

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass(frozen=True)
class Shard:
    """``i/n``: this exporter keeps the targets whose hash modulo n is i (0-based)."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> "Shard":
        left, sep, right = text.partition("/")
        try:
            index, count = int(left), int(right)
        except ValueError:
            raise TargetsError(f"shard {text!r}: expected I/N, e.g. 0/3") from None
        if not sep or count < 1 or not 0 <= index < count:
            raise TargetsError(f"shard {text!r}: expected I/N with 0 <= I < N")
        return cls(index, count)

    def keeps(self, url: str) -> bool:
        return shard_of(url, self.count) == self.index


def shard_of(url: str, count: int) -> int:
    """The shard a target URL falls in: the first 8 bytes of its SHA-1, modulo ``count``."""
    digest = hashlib.sha1(url.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


def make_target(url: Any, labels: Any, where: str) -> Target:
    """A Target from config values, refusing what is not a URL string or a string mapping."""
    where = f"{where}: " if where else ""
    if not isinstance(url, str) or not url.strip():
        raise TargetsError(f"{where}a target must be a URL or host:port string, got {url!r}")
    labels = labels or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float)) for k, v in labels.items()):
        raise TargetsError(f"{where}labels must be a mapping of name: value")
    for name in labels:
        if not _LABEL_RE.fullmatch(name) or name.startswith("__"):
            raise TargetsError(f"{where}{name!r} is not a valid Prometheus label name")
        if name in RESERVED_LABELS:
            raise TargetsError(f"{where}label {name!r} is set by kvdiag itself; pick another name")
    check_url(url.strip(), where)  # as written: urlsplit drops tabs and newlines where it rebuilds
    clean, basic = split_userinfo(url.strip())
    return Target(clean, tuple(sorted((str(k), str(v)) for k, v in labels.items())), basic)


def check_url(url: str, where: str = "") -> None:
    """Refuse what can never be scraped (``kvdiag.sources.urls.parse``: another scheme, no
    host or not a host name, a port outside 1-65535, whitespace or control characters)."""
    try:
        parse(url)
    except InvalidURL as exc:
        raise TargetsError(f"{where}{excerpt(redact(url))}: {exc}") from None


def parse_file_sd(data: Any, where: str) -> list[Target]:
    """Targets from a decoded file_sd document (a list of target groups)."""
    if data is None:
        return []
    if not isinstance(data, list):
        raise TargetsError(f"{where}: file_sd content must be a list of {{targets, labels}} groups")
    out = []
    for i, group in enumerate(data):
        if not isinstance(group, dict) or not isinstance(group.get("targets"), list):
            raise TargetsError(f"{where}: group {i} has no 'targets' list")
        out.extend(make_target(url, group.get("labels"), f"{where}: group {i}") for url in group["targets"])
    return out


@dataclass
class FileSD:
    """One file_sd file, re-read when its modification time changes."""

    path: Path
    targets: list[Target] = field(default_factory=list)
    error: str | None = None
    _mtime: float | None = None

    def refresh(self) -> bool:
        """Re-read the file if it changed; True when the target list changed."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError as exc:
            self.error = f"{self.path}: cannot read ({exc.strerror})"
            return False
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        try:
            text = self.path.read_text(encoding="utf-8")
            data = json.loads(text) if self.path.suffix == ".json" else yaml.safe_load(text)
            targets = parse_file_sd(data, str(self.path))
        except (OSError, ValueError, yaml.YAMLError) as exc:  # json errors are ValueErrors
            self.error = f"{self.path}: {exc}"
            return False
        self.error = None
        changed = targets != self.targets
        self.targets = targets
        return changed


def combine(static: Iterable[Target], files: Iterable[FileSD], shard: Shard) -> list[Target]:
    """Every configured target once (first definition wins), restricted to this shard."""
    seen: dict[str, Target] = {}
    for target in list(static) + [t for f in files for t in f.targets]:
        seen.setdefault(target.url, target)
    return [t for t in seen.values() if shard.keeps(t.url)]
