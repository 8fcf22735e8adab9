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
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str], list[str]]

#: Host names of instance-metadata services, refused by name before any resolution:
#: GCP (metadata.google.internal, metadata.goog, bare "metadata" in the VM's search domain),
#: AWS EC2 (instance-data, instance-data.ec2.internal), Tencent Cloud (metadata.tencentyun.com).
METADATA_NAMES = frozenset(
    {"metadata.google.internal", "metadata.goog", "metadata", "instance-data", "instance-data.ec2.internal", "metadata.tencentyun.com"}
)
#: Platform addresses of the major clouds, and the link-local ranges they live in. Facts, from
#: the providers' documentation:
#: - 169.254.0.0/16 (IPv4 link-local): the instance metadata service of AWS, GCP, Azure, OCI,
#:   Alibaba's ECS RAM role alias, DigitalOcean, OpenStack (169.254.169.254); AWS ECS task
#:   metadata/credentials (169.254.170.2); EKS Pod Identity agent (169.254.170.23); Tencent
#:   (169.254.0.23); AWS time sync (169.254.169.123) and DNS (169.254.169.253).
#: - fe80::/10 (IPv6 link-local): OpenStack's IPv6 metadata anycast fe80::a9fe:a9fe.
#: - fd00:ec2::254: AWS EC2 IMDS over IPv6; fd00:ec2::23: EKS Pod Identity agent over IPv6.
#: - 168.63.129.16: Azure's WireServer / platform virtual IP (VM agent, health probes, DNS).
#: - 100.100.100.200: Alibaba Cloud's instance metadata service.
#: - 192.0.0.192: Oracle Cloud (OCI classic / Cloud@Customer) instance metadata.
METADATA_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.0.0/16",
        "fe80::/10",
        "fd00:ec2::254/128",
        "fd00:ec2::23/128",
        "168.63.129.16/32",
        "100.100.100.200/32",
        "192.0.0.192/32",
    )
)
#: IPv6 prefixes whose low 32 bits carry an IPv4 address the packet ends up at: NAT64's
#: well-known prefix (RFC 6052) and its local-use prefix (RFC 8215).
NAT64_PREFIXES = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d (RFC 4291 2.5.5.1)
_LABEL_RE = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")


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


def embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address reaches or carries: mapped ``::ffff:a.b.c.d``,
    compatible ``::a.b.c.d``, NAT64 ``64:ff9b::a.b.c.d``, 6to4 ``2002:AABB:CCDD::`` and the
    Teredo client. A filter that looks at the IPv6 form alone lets all of these through."""
    if address.version == 4:
        return []
    out = []
    if address.ipv4_mapped is not None:
        out.append(address.ipv4_mapped)
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _IPV4_COMPATIBLE and int(address) > 1:
        out.append(low32)
    if any(address in net for net in NAT64_PREFIXES):
        out.append(low32)
    if address.sixtofour is not None:
        out.append(address.sixtofour)
    if address.teredo is not None:
        out.extend(address.teredo)
    return out


def is_metadata(address: IPAddress) -> bool:
    """A cloud platform address, in any of its IPv4 and IPv6 disguises."""
    return any(a in net for a in (address, *embedded_ipv4(address)) for net in METADATA_NETWORKS)


def valid_host(host: str) -> str:
    """The host lower-cased without its trailing dot; ProbeInvalid when it is not a DNS name
    (labels of 1-63 letters, digits, '-' or '_', 253 characters at most) or an IP literal."""
    host = host.lower().rstrip(".")
    if not host:
        raise ProbeInvalid("the URL has no host")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not host.isascii():
        raise ProbeInvalid(f"{host!r}: write international host names in punycode (xn--...)")
    if len(host) > 253 or not all(_LABEL_RE.fullmatch(label) for label in host.split(".")):
        raise ProbeInvalid(f"{host[:80]!r} is not a valid host name (labels of 1-63 letters, digits or '-')")
    return host


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
            parts = urlsplit(url)
            raw_host = parts.hostname or ""
            parts.port  # noqa: B018 (raises ValueError on a bad port)
        except ValueError as exc:
            raise ProbeInvalid(f"not a URL: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise ProbeInvalid("only http:// and https:// URLs with a host can be probed")
        if "[" in parts.netloc.rpartition("@")[2] and not _ipv6_literal(raw_host):
            raise ProbeInvalid(f"{raw_host!r} in brackets is not an IPv6 address")
        host = valid_host(raw_host)
        if parts.username is not None or parts.password is not None:
            raise ProbeRefused("credentials in the target URL are not accepted; configure probe.auth")
        if host in METADATA_NAMES or any(host.endswith("." + n) for n in METADATA_NAMES if "." in n):
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


def _ipv6_literal(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
