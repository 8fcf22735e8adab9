"""The exporter's configuration: one YAML file shared with ``diagnose``, flags on top.

The file holds the exporter's sections beside the checklist's ``checks:`` section (read by
``kvdiag.config``, the same thresholds ``diagnose`` uses)::

    listen: 127.0.0.1:10877
    api_bearer_token_file: /etc/kvdiag/api-token
    shard: 0/1
    scrape:
      interval: 5s
      timeout: 4s
      concurrency: 64
      max_body_bytes: 16777216
      evaluate_every: 15s
      auth: {bearer_token_file: /etc/kvdiag/engine-token, ca_file: /etc/ssl/engines.pem}
    targets:
      - http://10.0.0.5:30000
      - {url: http://10.0.0.6:8000, labels: {cluster: east}}
    file_sd: [/etc/prometheus/sd/engines.json]
    probe:
      hosts: [engine-0.internal]
      cidrs: [10.0.0.0/16]
      regex: 'https?://vllm-[0-9]+\\.svc:8000(/metrics)?'
      concurrency: 16
      auth:                      # sent only to probed hosts an entry names
        - {hosts: [engine-0.internal], bearer_token_file: /etc/kvdiag/engine-token}
    checks:
      window: 5m

Anything unknown or mistyped is refused at start with the file, line and key at fault: an
exporter that silently ignores a misspelt ``targets`` scrapes nothing and says nothing.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from kvdiag import config as checks_config
from kvdiag.config import Config, ConfigError
from kvdiag.exposition import DEFAULT_MAX_BYTES
from kvdiag.quantity import EVALUATE_EVERY, INTERVAL, MAX_BODY, TIMEOUT, Duration, Size
from kvdiag.server.probe import Allowlist, host_matches
from kvdiag.server.secretfile import check_secret, read_secret
from kvdiag.server.targets import Shard, Target, make_target
from kvdiag.sources.scrape import Auth

#: Not in the 9100-9999 exporter range, which Prometheus' port-allocation wiki lists as full.
DEFAULT_PORT = 10877
DEFAULT_HOST = "127.0.0.1"
#: Scrape or probe workers: each is a thread; beyond this a config is a typo, not a plan.
MAX_CONCURRENCY = 4096
#: Scrapes an instance's window may hold (window / interval): about a kilobyte each, so a few
#: tens of megabytes per instance at most (a day at a 5 s interval is 17,280).
MAX_WINDOW_ROWS = 20_000


@dataclass(frozen=True)
class ScrapeSettings:
    """How targets are scraped: every ``interval`` (with a per-target phase), each within
    ``timeout``, at most ``concurrency`` at once, bodies up to ``max_bytes``."""

    interval: float = 5.0
    timeout: float | None = None  # None: 80% of the interval, at most 10 s
    concurrency: int = 64
    max_bytes: int = DEFAULT_MAX_BYTES
    auth: Auth | None = None
    # Verdicts move over minutes and Prometheus reads them every 15-60 s, while the checks
    # cost more than a scrape on long windows: each instance is evaluated at most this often.
    evaluate_every: float = 15.0

    @property
    def effective_timeout(self) -> float:
        return self.timeout if self.timeout is not None else min(10.0, 0.8 * self.interval)


@dataclass(frozen=True)
class ProbeCredentials:
    """Credentials sent to the probed hosts that match ``hosts`` (names or ``*.suffix``)."""

    hosts: frozenset[str]
    auth: Auth


@dataclass(frozen=True)
class ProbeSettings:
    """What ``/probe`` may fetch, how many probes run at once (each on its own worker, never
    on the threads that serve /healthz, /metrics or the API), and the credentials it may send:
    none, unless an ``auth`` entry names the probed host (``scrape.auth`` is never used, as a
    probe target is whatever the caller asks for)."""

    allowlist: Allowlist = field(default_factory=Allowlist)
    concurrency: int = 16
    credentials: tuple[ProbeCredentials, ...] = ()

    def auth_for(self, host: str) -> Auth | None:
        host = host.lower().rstrip(".")
        return next((c.auth for c in self.credentials if host_matches(host, c.hosts)), None)


@dataclass(frozen=True)
class Settings:
    """Everything ``kvdiag serve`` runs with."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_token: str | None = None
    shard: Shard = Shard()
    scrape: ScrapeSettings = ScrapeSettings()
    targets: tuple[Target, ...] = ()
    file_sd: tuple[Path, ...] = ()
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    checks: Config = Config()


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` (loopback) or ``[v6]:PORT``; ValueError for anything else."""
    usage = f"listen {text!r}: expected HOST:PORT or [IPv6]:PORT, e.g. {DEFAULT_HOST}:{DEFAULT_PORT}"
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(usage)
    if host.startswith("[") or host.endswith("]") or ":" in host:
        if not (host.startswith("[") and host.endswith("]")):
            raise ValueError(usage)
        try:
            if ipaddress.ip_address(host[1:-1]).version != 6:
                raise ValueError
        except ValueError:
            raise ValueError(f"{usage} ({host} is not an IPv6 address)") from None
        return host[1:-1], int(port)
    if host and not _HOSTNAME_RE.fullmatch(host):
        raise ValueError(f"{usage} ({host!r} is not a host name or address)")
    return (host or DEFAULT_HOST), int(port)


def is_loopback(host: str) -> bool:
    """A listen address only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")


def _secret(section: dict[str, Any], key: str, base: Path) -> str | None:
    """A secret given inline (``key``) or, better, in a file (``key_file``); None when neither
    key is there. A key that is there but empty, or not a string, is an error: an empty
    ``api_bearer_token:`` read as "no token" would leave the API open without a word."""
    inline, in_file = key in section, key + "_file" in section
    if inline and in_file:
        raise ValueError(f"give {key} or {key}_file, not both")
    if in_file:
        name = section[key + "_file"]
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{key}_file is {'empty' if name in (None, '') else 'not a file name'}: give the file that holds the secret, or remove the key")
        return read_secret(base / name)
    if not inline:
        return None
    value = section[key]
    if value is None or value == "":
        raise ValueError(f"{key} is empty: give the secret (better, {key}_file), or remove the key")
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string (quote it in YAML)")
    return check_secret(value, key)


def _auth(data: Any, base: Path) -> Auth:
    data = _mapping(data, {"basic", "bearer_token", "bearer_token_file", "ca_file", "insecure_skip_verify"})
    basic = None
    if data.get("basic") is not None:
        b = _at(("basic",), _mapping, data["basic"], {"username", "password", "password_file"})
        if "username" not in b:
            raise FieldError(("basic",), "basic needs a username")
        basic = (str(b["username"]), _at(("basic",), _secret, b, "password", base) or "")
    ca = data.get("ca_file")
    if ca is not None and not (base / str(ca)).is_file():
        raise FieldError(("ca_file",), f"{base / str(ca)}: no such file")
    return Auth(
        basic=basic,
        bearer=_secret(data, "bearer_token", base),
        ca_file=str(base / str(ca)) if ca is not None else None,
        insecure=_at(("insecure_skip_verify",), _bool, data.get("insecure_skip_verify", False)),
    )


def _scrape(data: Any, base: Path) -> ScrapeSettings:
    data = _mapping(data, {"interval", "timeout", "concurrency", "max_body_bytes", "auth", "evaluate_every"})

    def quantity(key: str, q: Duration | Size, default: float) -> Any:
        return _at((key,), q.parse, data.get(key, default))

    timeout = quantity("timeout", TIMEOUT, 1.0) if "timeout" in data else None
    s = ScrapeSettings(
        interval=quantity("interval", INTERVAL, 5.0),
        timeout=timeout,
        concurrency=_at(("concurrency",), _concurrency, data.get("concurrency", 64)),
        max_bytes=quantity("max_body_bytes", MAX_BODY, DEFAULT_MAX_BYTES),
        evaluate_every=quantity("evaluate_every", EVALUATE_EVERY, 15.0),
        auth=_at(("auth",), _auth, data["auth"], base) if data.get("auth") is not None else None,
    )
    _at(("timeout",) if timeout is not None else (), check_timing, s)
    return s


def check_timing(s: ScrapeSettings) -> None:
    """A scrape must end before the next one of the same target is due."""
    if s.effective_timeout > s.interval:
        raise ValueError(f"timeout {s.effective_timeout:g}s exceeds the interval {s.interval:g}s")


def check_window(s: Settings) -> None:
    """Each instance keeps a window of scrapes in memory: at most MAX_WINDOW_ROWS of them."""
    rows = s.checks.window / s.scrape.interval
    if rows > MAX_WINDOW_ROWS:
        raise ValueError(
            f"a {s.checks.window:g}s window at a {s.scrape.interval:g}s interval keeps {rows:.0f} scrapes per instance; "
            f"at most {MAX_WINDOW_ROWS}: lengthen the interval or shorten the window"
        )


def _targets(data: Any) -> tuple[Target, ...]:
    if not isinstance(data, list):
        raise ValueError("targets must be a list of URLs or {url, labels} entries")
    out = []
    for i, item in enumerate(data):
        if isinstance(item, dict):
            unknown = set(item) - {"url", "labels"}
            if unknown:
                raise FieldError((i,), f"unknown key {sorted(unknown)[0]!r} (expected url, labels)")
            out.append(_at((i,), make_target, item.get("url"), item.get("labels"), ""))
        else:
            out.append(_at((i,), make_target, item, None, ""))
    return tuple(out)


def _probe(data: Any, base: Path) -> ProbeSettings:
    data = _mapping(data, {"hosts", "cidrs", "regex", "concurrency", "auth"})
    hosts = _at(("hosts",), _strings, data.get("hosts"))
    cidrs = _at(("cidrs",), _strings, data.get("cidrs"))
    allowlist = _at(("cidrs",) if cidrs else (), Allowlist.build, hosts, cidrs, data.get("regex"))
    concurrency = _at(("concurrency",), _concurrency, data.get("concurrency", 16))
    entries = data.get("auth") or []
    if not isinstance(entries, list):
        raise FieldError(("auth",), "expected a list of {hosts: [...], <credentials>} entries")
    credentials = tuple(_at(("auth", i), _probe_credentials, entry, base) for i, entry in enumerate(entries))
    return ProbeSettings(allowlist, concurrency, credentials)


def _probe_credentials(entry: Any, base: Path) -> ProbeCredentials:
    if not isinstance(entry, dict) or not entry.get("hosts"):
        raise ValueError("each probe.auth entry names the hosts it is for: {hosts: [...], bearer_token_file: ...}")
    hosts = _at(("hosts",), _strings, entry["hosts"])
    return ProbeCredentials(frozenset(h.lower().rstrip(".") for h in hosts), _auth({k: v for k, v in entry.items() if k != "hosts"}, base))


def _api_token(s: Settings, given: dict[str, Any], base: Path) -> str | None:
    if s.api_token is not None:
        raise ValueError("give api_bearer_token or api_bearer_token_file, not both")
    return _secret(given, "api_bearer_token", base)


#: Top-level keys: how each is read into Settings (``checks`` is kvdiag.config's).
_SECTIONS: dict[str, Callable[[Settings, Any, Path], Settings]] = {
    "listen": lambda s, v, b: replace(s, **dict(zip(("host", "port"), parse_listen(str(v))))),
    "api_bearer_token": lambda s, v, b: replace(s, api_token=_api_token(s, {"api_bearer_token": v}, b)),
    "api_bearer_token_file": lambda s, v, b: replace(s, api_token=_api_token(s, {"api_bearer_token_file": v}, b)),
    "shard": lambda s, v, b: replace(s, shard=Shard.parse(str(v))),
    "scrape": lambda s, v, b: replace(s, scrape=_scrape(v, b)),
    "targets": lambda s, v, b: replace(s, targets=_targets(v)),
    "file_sd": lambda s, v, b: replace(s, file_sd=tuple(b / p for p in _strings(v))),
    "probe": lambda s, v, b: replace(s, probe=_probe(v, b)),
}


def load(path: str | Path) -> Settings:
    """Settings from a YAML file; ConfigError names the file and line at fault.

    Relative paths inside the file (file_sd, token and CA files) are relative to the file.
    """
    path = Path(path)
    settings = Settings(checks=checks_config.load(path))  # reads and checks `checks:` itself
    root = checks_config.read_yaml(path)
    if root is None:
        return settings
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}:{root.start_mark.line + 1}: the file must be a mapping")
    seen: set[str] = set()
    for key_node, value_node in root.value:
        key, where = key_node.value, f"{path}:{key_node.start_mark.line + 1}"
        if key == checks_config.SECTION:
            continue
        if key not in _SECTIONS:
            raise ConfigError(f"{where}: unknown key {key!r}; known: {', '.join(sorted(_SECTIONS))}, {checks_config.SECTION}")
        if key in seen:
            raise ConfigError(f"{where}: {key} is given twice")
        seen.add(key)
        value = checks_config.value_of(value_node, path)
        try:
            settings = _SECTIONS[key](settings, value, path.parent)
        except FieldError as exc:
            line = _line(key_node, value_node, exc.path)
            raise ConfigError(f"{path}:{line}: {key}{''.join(_step(p) for p in exc.path)}: {exc.reason}") from None
        except (ValueError, TypeError) as exc:  # TargetsError and ConfigError are ValueErrors
            raise ConfigError(f"{where}: {key}: {exc}") from None
    if settings.api_token == "":
        raise ConfigError(f"{path}: the API bearer token is empty")
    try:
        check_window(settings)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return settings


class FieldError(ValueError):
    """A bad value inside a section, with its path (keys and list indexes) for the line."""

    def __init__(self, path: tuple[str | int, ...], reason: str) -> None:
        super().__init__(reason)
        self.path = path
        self.reason = reason


def _at(path: tuple[str | int, ...], fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn``; a ValueError it raises is blamed on ``path`` (nested paths are joined)."""
    try:
        return fn(*args)
    except FieldError as exc:
        raise FieldError(path + exc.path, exc.reason) from None
    except ValueError as exc:
        raise FieldError(path, str(exc)) from None


def _line(key_node: yaml.Node, node: yaml.Node, path: tuple[str | int, ...]) -> int:
    """The 1-based line of the node at ``path`` below a section (the deepest one found)."""
    line = key_node.start_mark.line + 1
    for step in path:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == step), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
            node = node.value[step]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _step(p: str | int) -> str:
    return f"[{p}]" if isinstance(p, int) else f".{p}"


def _mapping(data: Any, allowed: set[str]) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping with keys {', '.join(sorted(allowed))}")
    unknown = set(map(str, data)) - allowed
    if unknown:
        raise ValueError(f"unknown key {sorted(unknown)[0]!r}; known: {', '.join(sorted(allowed))}")
    return data


def _strings(data: Any) -> list[str]:
    if data is None:
        return []
    if isinstance(data, str):
        return [data]
    if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
        raise ValueError("expected a list of strings")
    return data


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{v!r} is not a whole number")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{v!r} is not true or false")
    return v


def _concurrency(v: Any) -> int:
    """Workers: a whole number from 1 to MAX_CONCURRENCY."""
    return _bounded(int(_positive(_int(v), "concurrency")), "concurrency", MAX_CONCURRENCY)


def _bounded(v: int, what: str, most: int) -> int:
    if v > most:
        raise ValueError(f"{what} {v} is more than {most}")
    return v


def _positive(v: float, what: str) -> float:
    if v <= 0:
        raise ValueError(f"{what} must be positive")
    return v

