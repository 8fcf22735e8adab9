"""Live scrapes over HTTP, as a Prometheus server would make them.

The Accept header is the one Prometheus 2.x sends, so an engine answers kvdiag exactly as it
answers the operator's Prometheus (OpenMetrics, with underscore-escaped names from
prometheus_client >= 0.23). Bodies are read in chunks up to a size cap, and every request
has a timeout: a huge or hung target costs bounded memory and time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import requests

from kvdiag.exposition import DEFAULT_MAX_BYTES
from kvdiag.model import Scrape

ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
USER_AGENT = "kvdiag"


class ScrapeError(RuntimeError):
    """A target that could not be scraped, with the reason."""


@dataclass
class Auth:
    """Credentials and TLS settings towards targets."""

    basic: tuple[str, str] | None = None
    bearer: str | None = None
    ca_file: str | None = None
    insecure: bool = False


def metrics_url(target: str) -> str:
    """A bare ``host:port`` or base URL gets ``/metrics``; a URL with a path is used as is."""
    url = target if "://" in target else "http://" + target
    scheme, rest = url.split("://", 1)
    return url if "/" in rest.strip("/") else url.rstrip("/") + "/metrics"


def scrape(
    target: str,
    timeout: float = 10.0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    session: requests.Session | None = None,
    auth: Auth | None = None,
) -> Scrape:
    """GET the target's metrics; raises ScrapeError on HTTP errors, timeouts and oversize."""
    url = metrics_url(target)
    headers = {"Accept": ACCEPT, "User-Agent": USER_AGENT}
    kwargs: dict = {"timeout": timeout, "stream": True, "headers": headers}
    if auth is not None:
        if auth.bearer:
            headers["Authorization"] = f"Bearer {auth.bearer}"
        if auth.basic:
            kwargs["auth"] = auth.basic
        kwargs["verify"] = False if auth.insecure else (auth.ca_file or True)
    http = session or requests
    deadline = time.monotonic() + timeout
    try:
        with http.get(url, **kwargs) as resp:
            if resp.status_code != 200:
                raise ScrapeError(f"{url}: HTTP {resp.status_code}")
            declared = resp.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise ScrapeError(f"{url}: body of {declared} bytes exceeds the {max_bytes}-byte cap")
            chunks, size = [], 0
            for chunk in resp.iter_content(65536):
                size += len(chunk)
                if size > max_bytes:
                    raise ScrapeError(f"{url}: body exceeds the {max_bytes}-byte cap")
                if time.monotonic() > deadline:
                    raise ScrapeError(f"{url}: body not complete within {timeout:g}s")
                chunks.append(chunk)
            raw = b"".join(chunks)
            content_type = resp.headers.get("Content-Type")
    except requests.RequestException as exc:
        raise ScrapeError(f"{url}: {type(exc).__name__}: {exc}") from None
    try:
        body = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError(f"{url}: body is not UTF-8") from None
    return Scrape(time.time(), target, content_type, body)
