"""Live scrapes over HTTP, as a Prometheus server would make them, under one deadline.

The Accept header is the one Prometheus 2.x sends, so an engine answers kvdiag exactly as it
answers the operator's Prometheus (OpenMetrics, with underscore-escaped names from
prometheus_client >= 0.23).

One deadline bounds the whole scrape: connect, TLS handshake, request, status line, headers,
body and every redirect together. A per-read timeout (what requests and urllib3 offer) is not
enough: a target that sends one byte a second never lets a read time out, and held a scrape
for 19 s against a 4 s timeout. Here every socket operation is given only what is left of the
deadline (``settimeout(remaining)`` before each ``recv``; CPython's connect, ``sendall`` and
TLS handshake are each bounded by the timeout they start with), so no target can stretch it.
Name resolution (``getaddrinfo``) is the one step no socket timeout reaches; callers that
must not depend on DNS pass the addresses to connect to (``vet``).

Bodies are capped in size (after decompression, so a gzip bomb is a refusal, not an
allocation). Credentials in a URL (``http://user:pass@host``) are taken out of it before
anything else happens: they become basic auth (in place of any bearer token, as the URL names
this one target's credentials), and only the redacted URL is ever named in a Scrape, an error
or a log line. Redirects follow ``kvdiag.sources.egress``: within the target's origin only,
to the addresses resolved for the first request.
"""

from __future__ import annotations

import base64
import http.client
import io
import math
import socket
import ssl
import time
import zlib
from dataclasses import dataclass, replace
from typing import Callable, Sequence
from urllib.parse import SplitResult

from kvdiag.excerpt import excerpt
from kvdiag.exposition import DEFAULT_MAX_BYTES
from kvdiag.model import Scrape
from kvdiag.sources.egress import MAX_REDIRECTS, REDIRECT_STATUSES, RedirectRefused, follow
from kvdiag.sources.urls import InvalidURL, parse, redact, split_userinfo

ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
USER_AGENT = "kvdiag"
CHUNK = 65536

#: Given a URL about to be fetched (the target, or where a redirect points), the addresses to
#: connect to; raises ValueError / PermissionError with the reason when the URL may not be
#: fetched. /probe passes its allowlist, so redirects are vetted and DNS answers pinned.
Vet = Callable[[str], Sequence[str]]


class ScrapeError(RuntimeError):
    """A target that could not be scraped, with the reason."""


def next_due(due: float, now: float, interval: float) -> float:
    """When a scrape cadence's next scrape is due, after the one due at ``due`` ended at ``now``.
    Slots missed meanwhile (a stalled target, a process starved on a busy machine) are skipped
    and the phase kept, as Prometheus schedules: caught up instead, they would come as a burst of
    scrapes milliseconds apart, which read as an engine that made no progress between them."""
    missed = max(0, math.floor((now - due) / interval))
    return due + (missed + 1) * interval


@dataclass(frozen=True)
class Auth:
    """Credentials and TLS settings towards targets."""

    basic: tuple[str, str] | None = None
    bearer: str | None = None
    ca_file: str | None = None
    insecure: bool = False

    @staticmethod
    def with_userinfo(auth: "Auth | None", userinfo: tuple[str, str] | None) -> "Auth | None":
        """The credentials for a target whose URL carried ``user:pass@``: those, as basic auth,
        in place of the shared ones (a bearer token would be sent instead of them otherwise);
        the TLS settings stay."""
        if userinfo is None:
            return auth
        return replace(auth or Auth(), basic=userinfo, bearer=None)

    def __repr__(self) -> str:  # secrets stay out of logs and tracebacks
        return f"Auth(basic={'***' if self.basic else None}, bearer={'***' if self.bearer else None}, ca_file={self.ca_file!r}, insecure={self.insecure})"


def metrics_url(target: str) -> str:
    """A bare ``host:port`` or base URL gets ``/metrics``; a URL with a path is used as is."""
    url = target if "://" in target else "http://" + target
    scheme, rest = url.split("://", 1)
    return url if "/" in rest.strip("/") else url.rstrip("/") + "/metrics"


def scrape(
    target: str,
    timeout: float = 10.0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    auth: Auth | None = None,
    redirects: int = MAX_REDIRECTS,
    vet: Vet | None = None,
) -> Scrape:
    """GET the target's metrics within ``timeout`` seconds in all; ScrapeError says why not
    (refused, timed out and in which phase, HTTP status, oversize, not UTF-8)."""
    try:
        parse(target)  # as written: splitting the userinfo off rebuilds the URL without tabs and newlines
    except InvalidURL as exc:
        raise ScrapeError(f"{excerpt(redact(target))}: {exc}") from None
    clean, userinfo = split_userinfo(target)
    auth = Auth.with_userinfo(auth, userinfo)
    url = metrics_url(clean)
    deadline = time.monotonic() + timeout
    # the target is vetted as it was given; without a vetter its name is resolved once, here,
    # and every redirect (same origin, so the same host) connects to those addresses
    addresses = _vetted(url, clean, vet, "")
    for _ in range(redirects + 1):
        status, headers, body = _fetch(url, deadline, timeout, max_bytes, auth, addresses)  # one origin: one host's credentials
        if status in REDIRECT_STATUSES and headers.get("location"):
            try:
                location = follow(url, status, headers["location"])
            except RedirectRefused as exc:
                raise ScrapeError(f"{url}: {exc}") from None
            if redirects == 0:
                raise ScrapeError(f"{url}: HTTP {status} redirect to {location} (redirects are not followed here)")
            addresses = _vetted(url, location, vet, f"HTTP {status} redirect to {location} ") if vet is not None else addresses
            url = location
            continue
        if status != 200:
            raise ScrapeError(f"{url}: HTTP {status}")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise ScrapeError(f"{url}: body is not UTF-8") from None
        return Scrape(time.time(), clean, headers.get("content-type"), text)
    raise ScrapeError(f"{metrics_url(clean)}: more than {redirects} redirects")


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline reached")
    return left


class _DeadlineIO(io.RawIOBase):
    """A socket's reads, each allowed only what is left of the scrape's deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: "bytearray | memoryview") -> int:  # type: ignore[override]
        self._sock.settimeout(_remaining(self._deadline))
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """What http.client.HTTPResponse needs of a socket (``makefile``), deadline-bound."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineIO(self._sock, self._deadline), CHUNK)


def _vetted(url: str, hop: str, vet: Vet | None, what: str) -> list[str]:
    """The addresses to connect to for the next hop: those ``vet`` allows, else the name's
    own (resolved once per scrape, so a rebinding name cannot move a redirect elsewhere)."""
    if vet is None:
        try:
            return _resolve(parse(hop).hostname or "")
        except InvalidURL as exc:
            raise ScrapeError(f"{url}: {exc}") from None
        except (OSError, ValueError) as exc:
            raise ScrapeError(f"{url}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    try:
        return list(vet(hop))
    except (PermissionError, ValueError) as exc:
        raise ScrapeError(f"{url}: {what}refused: {exc}") from None


def _fetch(url: str, deadline: float, timeout: float, max_bytes: int, auth: Auth | None, addresses: list[str]) -> tuple[int, dict[str, str], bytes]:
    """One request: (status, lower-cased headers, decoded body); ScrapeError on any failure."""
    try:
        parts = parse(url)
    except InvalidURL as exc:
        raise ScrapeError(f"{url}: {exc}") from None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    request = _request(parts, auth)
    phase = "connect"
    sock: socket.socket | None = None
    try:
        sock = _connect(addresses, port, deadline)
        if parts.scheme == "https":
            phase = "TLS handshake"
            sock.settimeout(_remaining(deadline))
            sock = _tls_context(auth).wrap_socket(sock, server_hostname=host)
        phase = "request"
        sock.settimeout(_remaining(deadline))
        sock.sendall(request)
        phase = "headers"
        resp = http.client.HTTPResponse(_DeadlineSocket(sock, deadline), method="GET")  # type: ignore[arg-type]
        resp.begin()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        if resp.status != 200:
            return resp.status, headers, b""
        phase = "body"
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise ScrapeError(f"{url}: body of {declared} bytes exceeds the {max_bytes}-byte cap")
        return resp.status, headers, _body(resp, headers.get("content-encoding", "identity"), max_bytes, url)
    except (TimeoutError, socket.timeout):
        raise ScrapeError(f"{url}: timed out after {timeout:g}s in all (during the {phase})") from None
    except ConnectionRefusedError:
        raise ScrapeError(f"{url}: connection refused") from None
    except ssl.SSLError as exc:
        raise ScrapeError(f"{url}: TLS: {exc.reason or exc}") from None
    except http.client.HTTPException as exc:
        raise ScrapeError(f"{url}: not a valid HTTP response ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:  # a host name IDNA cannot encode
        raise ScrapeError(f"{url}: {exc}") from None
    except OSError as exc:
        raise ScrapeError(f"{url}: {exc.strerror or type(exc).__name__} (during the {phase})") from None
    finally:
        if sock is not None:
            sock.close()


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"cannot resolve {host!r}: {exc.strerror}") from None
    except UnicodeError:
        raise ValueError(f"{host!r} is not a valid host name") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


def _connect(addresses: Sequence[str], port: int, deadline: float) -> socket.socket:
    """The first address that accepts, each attempt bounded by what is left."""
    error: OSError = OSError(0, "no address to connect to")
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect((address, port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except (TimeoutError, socket.timeout):
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            error = exc
    raise error


def _tls_context(auth: Auth | None) -> ssl.SSLContext:
    if auth is not None and auth.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    return ssl.create_default_context(cafile=auth.ca_file if auth is not None else None)


def _request(parts: SplitResult, auth: Auth | None) -> bytes:
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host = parts.netloc.rpartition("@")[2]
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host}",
        f"Accept: {ACCEPT}",
        "Accept-Encoding: gzip",
        f"User-Agent: {USER_AGENT}",
        "Connection: close",
    ]
    if auth is not None and auth.bearer:
        lines.append(f"Authorization: Bearer {auth.bearer}")
    elif auth is not None and auth.basic:
        token = base64.b64encode(f"{auth.basic[0]}:{auth.basic[1]}".encode("utf-8")).decode("ascii")
        lines.append(f"Authorization: Basic {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")


def _body(resp: http.client.HTTPResponse, encoding: str, max_bytes: int, url: str) -> bytes:
    """The body, decompressed, never more than ``max_bytes`` of it held."""
    encoding = encoding.strip().lower()
    if encoding not in ("identity", "gzip", ""):
        raise ScrapeError(f"{url}: Content-Encoding {encoding!r} is not supported")
    inflate = zlib.decompressobj(wbits=31) if encoding == "gzip" else None
    out = bytearray()
    try:
        while True:
            raw = resp.read(CHUNK)
            if inflate is None:
                if not raw:
                    break
                out += raw
            else:
                data = inflate.unconsumed_tail + raw
                if not data:
                    out += inflate.flush()
                    break
                # at most one byte past the cap per call: the rest waits in unconsumed_tail
                out += inflate.decompress(data, max_bytes + 1 - len(out))
            if len(out) > max_bytes:
                raise ScrapeError(f"{url}: body exceeds the {max_bytes}-byte cap")
    except zlib.error as exc:
        raise ScrapeError(f"{url}: gzip body is corrupt ({exc})") from None
    if inflate is not None and not inflate.eof:
        raise ScrapeError(f"{url}: gzip body is truncated")
    return bytes(out)
