"""Past windows from a Prometheus server, through the same adapters as a live scrape.

One ``query_range`` fetches every series of the engine families the adapters read (as stored:
``name``, ``name_total``, ``_bucket``/``_sum``/``_count``, with the colon or underscore-escaped
as Prometheus 2.x stores OpenMetrics-escaped scrapes). The result is regrouped per scrape
target (``job``, ``instance``) and evaluation timestamp into ``Exposition`` objects, which the
engine adapters detect and normalize exactly as they do a scraped body: one normalization
path, whatever the source. Counters come back raw (no ``rate()``), so the Window's reset-safe
arithmetic applies unchanged.

Targets that Prometheus scrapes (``up``) but that serve none of those families are reported
back, so an engine with metrics turned off is named rather than silently missing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Iterable

import requests

from kvdiag import engines
from kvdiag.excerpt import excerpt
from kvdiag.exposition import SUFFIXES, Exposition, Family, Sample, sample_names
from kvdiag.model import PoolSample
from kvdiag.sources.egress import MAX_REDIRECTS, REDIRECT_STATUSES, RedirectRefused, follow
from kvdiag.sources.urls import split_userinfo

#: Prometheus refuses a query_range of more than 11,000 points per series.
MAX_POINTS = 11_000
#: Target labels Prometheus adds; the adapters see the engine's own labels only.
TARGET_LABELS = ("job", "instance")


class PrometheusError(RuntimeError):
    """The Prometheus server could not answer; says which request and why."""


@dataclass
class Result:
    """What a Prometheus window yields: normalized samples, and targets it could not use."""

    samples: list[PoolSample] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)  # target -> why it has no samples
    start: float = 0.0
    end: float = 0.0
    step: float = 0.0


def series_regex(families: Iterable[str]) -> str:
    """A ``__name__`` regex (RE2, anchored by Prometheus) matching every stored spelling."""
    names = sorted({re.escape(f).replace(":", "[:_]") for f in families})
    suffixes = "|".join(SUFFIXES)
    return f"(?:{'|'.join(names)})(?:{suffixes})?"


def matchers(selector: str) -> str:
    """``{job="x", env="y"}`` (or the same without braces) to the inner matcher list."""
    s = selector.strip()
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    if "{" in s or "}" in s:
        raise ValueError(f"selector {selector!r}: give label matchers only, like '{{job=\"sglang\"}}'")
    return s.strip().strip(",")


def default_step(seconds: float) -> float:
    """About 720 points over the span (5 s for an hour), never under 1 s or over the limit."""
    return max(1.0, seconds / 720.0, seconds / MAX_POINTS)


class Prometheus:
    """A client for the two API calls kvdiag needs."""

    def __init__(self, url: str, timeout: float = 30.0, session: requests.Session | None = None) -> None:
        clean, userinfo = split_userinfo(url)
        self.url = clean.rstrip("/")
        self.timeout = timeout
        self.http = session or requests.Session()
        if userinfo is not None:  # basic auth, and a URL that never names the password
            self.http.auth = userinfo

    def _call(self, path: str, params: dict[str, str]) -> list[dict]:
        """POST ``path``; redirects are followed by ``kvdiag.sources.egress``'s policy (within
        the server's origin only), never by requests (which follows them anywhere)."""
        where = url = f"{self.url}{path}"
        for _ in range(MAX_REDIRECTS + 1):
            try:
                resp = self.http.post(url, data=params, timeout=self.timeout, allow_redirects=False)
            except requests.RequestException as exc:
                raise PrometheusError(f"{where}: {type(exc).__name__}: {exc}") from None
            if resp.status_code not in REDIRECT_STATUSES or not resp.headers.get("location"):
                break
            try:
                url = follow(url, resp.status_code, resp.headers["location"])
            except RedirectRefused as exc:
                raise PrometheusError(f"{where}: {exc}") from None
        else:
            raise PrometheusError(f"{where}: more than {MAX_REDIRECTS} redirects")
        try:
            body = resp.json()
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict) or body.get("status") not in ("success", "error"):
            raise PrometheusError(f"{where}: HTTP {resp.status_code}, not a Prometheus API answer")
        if body.get("status") != "success":
            raise PrometheusError(f"{where}: {excerpt(str(body.get('errorType', 'error')), 40)}: {excerpt(str(body.get('error', resp.status_code)), 300)}")
        try:
            return list(body["data"]["result"])
        except (KeyError, TypeError):
            raise PrometheusError(f"{where}: HTTP {resp.status_code}, an answer without data.result") from None

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict]:
        return self._call("/api/v1/query_range", {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}s"})

    def query(self, query: str, at: float) -> list[dict]:
        return self._call("/api/v1/query", {"query": query, "time": f"{at:.3f}"})


def read_window(
    url: str,
    selector: str = "",
    since: float = 3600.0,
    step: float | None = None,
    end: float | None = None,
    engine: str = "auto",
    timeout: float = 30.0,
) -> Result:
    """Samples of every engine instance the selector matches over ``[end - since, end]``."""
    end = time.time() if end is None else end
    start = end - since
    step = step or default_step(since)
    if since / step > MAX_POINTS:
        raise ValueError(f"--since {since:g}s at a {step:g}s step exceeds Prometheus' {MAX_POINTS} points; raise --step")
    inner = matchers(selector)
    extra = f",{inner}" if inner else ""
    prom = Prometheus(url, timeout)
    series = prom.query_range(f'{{__name__=~"{series_regex(engines.READER.wanted)}"{extra}}}', start, end, step)
    result = Result(start=start, end=end, step=step)
    seen: set[tuple[str, str]] = set()
    for key, frames in _regroup(series).items():
        seen.add(key)
        target = _target(key)
        before = len(result.samples)
        for ts in sorted(frames):
            expo = Exposition(frames[ts], openmetrics=False, size=0)
            try:
                adapter = engines.detect(expo, engine=engine)
            except engines.UnknownEngine as exc:
                result.problems.setdefault(target, str(exc))
                continue
            result.samples.extend(adapter.normalize(expo, target, ts))
        if len(result.samples) > before:
            result.problems.pop(target, None)  # some moments lacked the signature series only
    for row in prom.query(f"max_over_time(up{{{inner}}}[{int(since)}s])", end):
        key = (row["metric"].get("job", ""), row["metric"].get("instance", ""))
        if key in seen:
            continue
        if float(row["value"][1]) == 0:
            result.problems[_target(key)] = "target was down (up == 0) for the whole span"
        else:
            hints = "; ".join(engines.enable_hint(name) for name in engines.ADAPTERS)
            result.problems[_target(key)] = f"scraped by Prometheus but serves none of the engine metrics kvdiag reads; {hints}"
    return result


def _regroup(series: list[dict]) -> dict[tuple[str, str], dict[float, dict[str, Family]]]:
    """Series -> per target, per timestamp, the families of an exposition at that moment."""
    resolve = _resolver(engines.READER.wanted)
    out: dict[tuple[str, str], dict[float, dict[str, Family]]] = {}
    for s in series:
        metric = dict(s["metric"])
        name = metric.pop("__name__", "")
        if name not in resolve:
            continue
        fam_name, suffix, escaped = resolve[name]
        key = (metric.pop("job", ""), metric.pop("instance", ""))
        frames = out.setdefault(key, {})
        for ts, raw in s["values"]:
            families = frames.setdefault(float(ts), {})
            fam = families.get(fam_name)
            if fam is None:
                fam = families[fam_name] = Family(fam_name, escaped=escaped)
            fam.samples.append(Sample(suffix, metric, float(raw), None, 0))
    return out


def _resolver(wanted: Iterable[str]) -> dict[str, tuple[str, str, bool]]:
    """Every stored series name (as the reader spells it under each escaping scheme) to
    (family, suffix, escaped); the bare name wins."""
    return {name: (fam, suffix, scheme != "") for name, (fam, suffix, scheme) in sample_names(wanted).items()}


def _target(key: tuple[str, str]) -> str:
    job, instance = key
    return instance or job or "prometheus"
