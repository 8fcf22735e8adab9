"""Which ``/probe?target=`` URLs the exporter may fetch: an allowlist, and never metadata.

``/probe`` makes the exporter send a request wherever the query string says, so without a
check it is a server-side request forgery hole (a scraper config, or anyone who can reach the
port, could read a cloud metadata service through it). A target is fetched only when its host
is listed, its URL matches the configured regex, or every address its host resolves to lies
in a listed CIDR. Cloud metadata endpoints are refused even when a rule would allow them: by
name, by address, and after resolving the name (a host name that resolves to 169.254.169.254
is a metadata address with a disguise), and in every IPv6 form that carries an IPv4 address.
The scrape connects to the addresses the check vetted (and vets every redirect the same way),
so a name that changes its answer between the check and the scrape (DNS rebinding) cannot
lead it elsewhere. A malformed target is the caller's mistake (ProbeInvalid, HTTP 400); one
the rules do not allow is a refusal (ProbeRefused, HTTP 403).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kvdiag.sources.egress import is_metadata, metadata_host
from kvdiag.sources.urls import InvalidURL, parse, valid_host

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str], list[str]]


class ProbeRefused(PermissionError):
    """The target is not allowed; the message says why (it is shown to the caller)."""


class ProbeInvalid(ValueError):
    """The target is not a well-formed URL (the caller's mistake: HTTP 400, not 403)."""


def resolve(host: str) -> list[str]:
    """Every address ``host`` resolves to (an IP literal resolves to itself)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ProbeRefused(f"cannot resolve {host!r}: {exc.strerror}") from None
    except UnicodeError:
        raise ProbeInvalid(f"{host!r} is not a valid host name") from None
    return sorted({info[4][0].split("%")[0] for info in infos})


def host_matches(host: str, patterns: Iterable[str]) -> bool:
    """``host`` is one of the names, or under a ``*.suffix`` pattern."""
    return any(host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in patterns)


@dataclass(frozen=True)
class Allowlist:
    """Host names (exact, or ``*.suffix``), CIDRs and a URL regex; empty refuses everything."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()
    pattern: re.Pattern[str] | None = None
    resolver: Resolver = field(default=resolve, compare=False)

    @classmethod
    def build(cls, hosts: Iterable[str] = (), cidrs: Iterable[str] = (), regex: str | None = None, resolver: Resolver = resolve) -> "Allowlist":
        """From config strings; ValueError names a CIDR or regex that does not parse."""
        networks = []
        for cidr in cidrs:
            try:
                networks.append(ipaddress.ip_network(cidr, strict=False))
            except ValueError:
                raise ValueError(f"{cidr!r} is not a CIDR (e.g. 10.0.0.0/16)") from None
        try:
            pattern = re.compile(regex) if regex else None
        except re.error as exc:
            raise ValueError(f"regex {regex!r} does not compile: {exc}") from None
        return cls(frozenset(h.lower().rstrip(".") for h in hosts), tuple(networks), pattern, resolver)

    @property
    def empty(self) -> bool:
        return not self.hosts and not self.networks and self.pattern is None

    def check(self, target: str) -> str:
        """The target as a URL when it may be probed; ProbeInvalid for a malformed one,
        ProbeRefused for one the allowlist does not cover."""
        return self.vet_url(target)[0]

    def addresses(self, url: str) -> list[str]:
        """The vetted addresses to connect to for ``url`` (the scrape pins them, so a DNS
        answer that changes after the check cannot lead elsewhere); also used for redirects."""
        return self.vet_url(url)[1]

    def vet_url(self, target: str) -> tuple[str, list[str]]:
        url = target if "://" in target else "http://" + target
        try:
            parts = parse(url)
            host = valid_host(parts.hostname or "")
        except InvalidURL as exc:
            raise ProbeInvalid(str(exc)) from None
        if parts.username is not None or parts.password is not None:
            raise ProbeRefused("credentials in the target URL are not accepted; configure probe.auth")
        if metadata_host(host) and not _ip_literal(host):
            raise ProbeRefused(f"{host} is a cloud metadata service")
        addresses = [ipaddress.ip_address(a) for a in self.resolver(host)]
        if not addresses:
            raise ProbeRefused(f"{host} resolves to no address")
        bad = [a for a in addresses if is_metadata(a)]
        if bad:
            raise ProbeRefused(f"{host} resolves to {bad[0]}, a link-local / cloud metadata address")
        if any(a.is_unspecified for a in addresses):
            raise ProbeRefused(f"{host} is the unspecified address (this host)")
        listed = host_matches(host, self.hosts) or (self.pattern is not None and self.pattern.fullmatch(url))
        if listed or (self.networks and all(any(a in net for net in self.networks) for a in addresses)):
            return url, [str(a) for a in addresses]
        raise ProbeRefused(f"{url} is not in the probe allowlist (probe.hosts, probe.cidrs, probe.regex)")


def _ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
