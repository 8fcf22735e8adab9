"""Which ``/probe?target=`` URLs the exporter may fetch: an allowlist, and never metadata.

``/probe`` makes the exporter send a request wherever the query string says, so without a
check it is a server-side request forgery hole (a scraper config, or anyone who can reach the
port, could read a cloud metadata service through it). A target is fetched only when its host
is listed, its URL matches the configured regex, or every address its host resolves to lies
in a listed CIDR. Cloud metadata endpoints are refused even when a rule would allow them: by
name, by address, and after resolving the name (a host name that resolves to 169.254.169.254
is a metadata address with a disguise). Names are resolved at check time; list only names
whose DNS you trust, as a name that changes its answer between the check and the scrape
(DNS rebinding) would get around the address rules.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import Callable, Iterable
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str], list[str]]

#: Host names of instance-metadata services (GCP, Azure/AWS aliases, Alibaba, OCI).
METADATA_NAMES = frozenset({"metadata.google.internal", "metadata.goog", "metadata", "instance-data", "instance-data.ec2.internal"})
#: Metadata addresses, and the link-local ranges every cloud puts them in.
METADATA_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "100.100.100.200/32", "192.0.0.192/32")
)


class ProbeRefused(PermissionError):
    """The target is not allowed; the message says why (it is shown to the caller)."""


def resolve(host: str) -> list[str]:
    """Every address ``host`` resolves to (an IP literal resolves to itself)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ProbeRefused(f"cannot resolve {host!r}: {exc.strerror}") from None
    return sorted({info[4][0].split("%")[0] for info in infos})


def is_metadata(address: IPAddress) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return any(address in net or (mapped is not None and mapped in net) for net in METADATA_NETWORKS)


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
        """The target as a URL when it may be probed; ProbeRefused otherwise."""
        url = target if "://" in target else "http://" + target
        try:
            parts = urlsplit(url)
            host = (parts.hostname or "").lower().rstrip(".")
            parts.port  # noqa: B018 (raises ValueError on a bad port)
        except ValueError as exc:
            raise ProbeRefused(f"not a URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not host:
            raise ProbeRefused("only http:// and https:// URLs with a host can be probed")
        if parts.username is not None or parts.password is not None:
            raise ProbeRefused("credentials in the target URL are not accepted; configure scrape.auth")
        if host in METADATA_NAMES:
            raise ProbeRefused(f"{host} is a cloud metadata service")
        addresses = [ipaddress.ip_address(a) for a in self.resolver(host)]
        if not addresses:
            raise ProbeRefused(f"{host} resolves to no address")
        bad = [a for a in addresses if is_metadata(a)]
        if bad:
            raise ProbeRefused(f"{host} resolves to {bad[0]}, a link-local / cloud metadata address")
        if self._host_listed(host) or (self.pattern is not None and self.pattern.fullmatch(url)):
            return url
        if self.networks and all(any(a in net for net in self.networks) for a in addresses):
            return url
        raise ProbeRefused(f"{url} is not in the probe allowlist (probe.hosts, probe.cidrs, probe.regex)")

    def _host_listed(self, host: str) -> bool:
        return host in self.hosts or any(h.startswith("*.") and host.endswith(h[1:]) for h in self.hosts)
