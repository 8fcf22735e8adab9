"""What an engine URL is: one reading for the config, file_sd, ``/probe`` and the scrape itself.

A URL that kvdiag would refuse at scrape time is refused where it is written (config load,
file_sd, ``/probe``'s query string), with the same reason, so a typo is an error at start and
not a target that is down forever. Userinfo (``http://user:pass@host``) is split off before
anything else: only the URL without it is ever named.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import SplitResult, urlsplit, urlunsplit

_LABEL_RE = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
#: Characters no URL kvdiag fetches may hold anywhere: whitespace and controls would end up
#: in the request line or a header (request smuggling), or name a different resource.
_UNSAFE_RE = re.compile(r"[\x00-\x20\x7f]")
_BRACKETED_RE = re.compile(r"\[[0-9A-Fa-f:.]+\](?::[0-9]*)?")


class InvalidURL(ValueError):
    """Not a URL kvdiag can fetch; the message says why."""


def split_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """The URL without ``user:pass@`` and the credentials it carried (None when none). A URL
    that does not split is given back as it is: ``parse`` says what is wrong with it."""
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
    except ValueError:
        return url, None
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    clean = urlunsplit(parts._replace(netloc=hostport))
    return (clean if "://" in url else clean.split("://", 1)[1]), (user, password)


def redact(url: str) -> str:
    """The URL as it may be shown: without userinfo."""
    return split_userinfo(url)[0]


def valid_host(host: str) -> str:
    """The host lower-cased without its trailing dot; InvalidURL when it is not a DNS name
    (labels of 1-63 letters, digits, '-' or '_', 253 characters at most) or an IP literal."""
    host = host.lower().rstrip(".")
    if not host:
        raise InvalidURL("the URL has no host")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not host.isascii():
        raise InvalidURL(f"{host[:80]!r}: write international host names in punycode (xn--...)")
    if len(host) > 253 or not all(_LABEL_RE.fullmatch(label) for label in host.split(".")):
        raise InvalidURL(f"{host[:80]!r} is not a valid host name (labels of 1-63 letters, digits or '-')")
    return host


def parse(url: str) -> SplitResult:
    """``url`` (``host:port`` gets ``http://``) taken apart, when kvdiag can fetch it: http or
    https, a valid host, a port from 1 to 65535 when one is written, no whitespace or control
    character anywhere. InvalidURL says what is wrong."""
    if _UNSAFE_RE.search(url) or not url.isprintable():
        raise InvalidURL("the URL holds spaces or control characters")
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
    except ValueError as exc:
        raise InvalidURL(f"not a URL ({exc})") from None
    try:
        port = parts.port
    except ValueError:
        port = 0
    if parts.scheme not in ("http", "https"):
        raise InvalidURL("only http:// and https:// URLs with a host can be scraped")
    hostport = parts.netloc.rpartition("@")[2]
    if "[" in hostport and not (_ipv6_literal(parts.hostname or "") and _BRACKETED_RE.fullmatch(hostport)):
        raise InvalidURL(f"{hostport[:80]!r} is not an IPv6 address in brackets (and a port)")
    valid_host(parts.hostname or "")
    if port == 0 or (port is None and hostport.endswith(":")):
        raise InvalidURL("the port is not a number from 1 to 65535")
    return parts


def origin(parts: SplitResult) -> tuple[str, str, int]:
    """(scheme, host, port) with the scheme's default port filled in."""
    return parts.scheme, (parts.hostname or "").lower().rstrip("."), parts.port or (443 if parts.scheme == "https" else 80)


def _ipv6_literal(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
