"""Where kvdiag's outbound requests may go: one redirect policy for every request it makes.

Configured targets, file_sd targets, ``/probe`` targets and the Prometheus server of
``diagnose --prometheus`` all follow the same rule: a redirect is followed only within the
origin it came from (same host and port, same scheme or http upgraded to https on the default
ports), at most ``MAX_REDIRECTS`` times, to addresses resolved once for the first request
(a name that answers differently on the second lookup cannot move the scrape). A redirect to
another host is refused before any connection, with the place it pointed to named (bounded
and escaped); one to a cloud metadata service or a link-local address says so. Prometheus'
``follow_redirects`` and the blackbox exporter follow redirects anywhere by default; kvdiag
does not, because the engine a target names is the one kvdiag reports on, and an answer from
elsewhere (a metadata service's credentials) would be quoted in its errors. The one redirect
engines send, Starlette's ``/metrics`` -> ``/metrics/``, stays within the origin.

Metadata facts (names and addresses of the major clouds' instance-metadata services) live here
and ``/probe``'s allowlist refuses them as targets too (``kvdiag.server.probe``).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urljoin

from kvdiag.excerpt import excerpt
from kvdiag.sources.urls import InvalidURL, origin, parse, redact

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Redirects followed for one request: a plain Starlette ``Mount("/metrics")`` answers
#: ``/metrics`` with a 307 to ``/metrics/`` (SGLang 0.5.23 and vLLM 0.33.0 patch their mount's
#: path regex to avoid it; proxies and other builds may not).
MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})

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


class RedirectRefused(PermissionError):
    """A redirect kvdiag does not follow; the message says where it pointed and why not."""


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


def metadata_host(host: str) -> bool:
    """A metadata service's name, or an IP literal in a metadata / link-local range."""
    host = host.lower().rstrip(".")
    if host in METADATA_NAMES or any(host.endswith("." + n) for n in METADATA_NAMES if "." in n):
        return True
    try:
        return is_metadata(ipaddress.ip_address(host))
    except ValueError:
        return False


def follow(url: str, status: int, location: str) -> str:
    """The URL a ``status`` redirect from ``url`` to ``location`` leads to, when the policy
    allows it (without userinfo: credentials never travel in a redirect); RedirectRefused
    otherwise, naming the place it pointed to as a bounded, escaped excerpt."""
    shown = excerpt(redact(location), 120)
    try:
        hop = parse(urljoin(url, location))
    except (InvalidURL, ValueError) as exc:
        raise RedirectRefused(f"HTTP {status} redirect to {shown} refused: {exc}") from None
    if metadata_host(hop.hostname or ""):
        raise RedirectRefused(f"HTTP {status} redirect to {shown} refused: a link-local / cloud metadata address")
    here, there = origin(parse(url)), origin(hop)
    upgrade = here == ("http", there[1], 80) and there[0] == "https" and there[2] == 443
    if here != there and not upgrade:
        raise RedirectRefused(
            f"HTTP {status} redirect to {shown} refused: kvdiag follows redirects within the target's "
            "own scheme, host and port only (name the final URL as the target if it is the engine)"
        )
    return redact(hop.geturl())
