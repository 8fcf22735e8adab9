"""The /probe allowlist (an SSRF list): listed hosts, CIDRs and a regex pass; everything else,
every cloud platform address however it is written, and malformed hosts are refused."""

from __future__ import annotations

import pytest

from kvdiag.server.probe import Allowlist, ProbeInvalid, ProbeRefused, resolve

FAKE_DNS = {
    "engine-0.internal": ["10.0.0.7"],
    "sneaky.example": ["169.254.169.254"],
    "v6meta.example": ["fd00:ec2::254"],
    "azure.example": ["168.63.129.16"],
    "outside.example": ["203.0.113.9"],
    "split.example": ["10.0.0.8", "203.0.113.10"],
    "vllm-3": ["10.1.0.3"],
}


def resolver(host: str) -> list[str]:
    """Fake DNS for names; IP literals and numeric forms go through the real resolver
    (getaddrinfo parses them without any network), as does localhost (/etc/hosts)."""
    return FAKE_DNS[host] if host in FAKE_DNS else resolve(host)


ALLOW = Allowlist.build(
    hosts=["engine-0.internal", "sneaky.example", "*.svc.local"],
    cidrs=["10.0.0.0/16", "169.254.0.0/16"],
    regex=r"http://vllm-[0-9]+:8000(/metrics)?",
    resolver=resolver,
)
#: An operator who allows everything still never reaches a platform address.
BROAD = Allowlist.build(cidrs=["0.0.0.0/0", "::/0"], hosts=["azure.example", "sneaky.example", "v6meta.example"], resolver=resolver)
#: A strict allowlist: one engine subnet; loopback in any spelling is outside it.
STRICT = Allowlist.build(cidrs=["10.0.0.0/16"], resolver=resolver)


@pytest.mark.parametrize("target", ["engine-0.internal:30000", "http://10.0.3.4:8000/metrics", "https://10.0.0.1", "http://vllm-3:8000", "http://ENGINE-0.internal.:30000"])
def test_allowed(target: str) -> None:
    assert ALLOW.check(target).startswith("http")


@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/latest/meta-data/",  # AWS / GCP / Azure / OCI IMDS
        "http://169.254.170.2/v2/credentials",  # AWS ECS task credentials
        "http://169.254.170.23/",  # EKS Pod Identity agent
        "http://[fd00:ec2::254]/latest",  # AWS IMDS over IPv6
        "http://[fd00:ec2::23]/",  # EKS Pod Identity over IPv6
        "http://168.63.129.16/machine?comp=goalstate",  # Azure WireServer
        "http://100.100.100.200/latest/meta-data/",  # Alibaba Cloud
        "http://192.0.0.192/latest",  # Oracle Cloud
        "http://[fe80::a9fe:a9fe]/",  # OpenStack IPv6 metadata
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://METADATA.GOOGLE.INTERNAL./computeMetadata/v1/",
        "http://metadata.goog/",
        "http://metadata/",
        "http://metadata.tencentyun.com/latest/meta-data/",
        "http://[::ffff:169.254.169.254]/",  # IPv4-mapped
        "http://[::ffff:a9fe:a9fe]/",  # IPv4-mapped, hex
        "http://[::169.254.169.254]/",  # IPv4-compatible
        "http://[64:ff9b::169.254.169.254]/",  # NAT64 well-known prefix
        "http://[64:ff9b:1::a9fe:a9fe]/",  # NAT64 local-use prefix
        "http://[2002:a9fe:a9fe::1]/",  # 6to4
        "http://[::ffff:168.63.129.16]/",
        "http://[64:ff9b::100.100.100.200]/",
        "http://2852039166/",  # 169.254.169.254 as one decimal number
        "http://0251.0376.0251.0376/",  # octal
        "http://0xa9.0xfe.0xa9.0xfe/",  # hex
        "http://169.254.43518/",  # a.b.c short form
        "http://sneaky.example/",  # a listed host whose DNS answer is a metadata address
        "http://v6meta.example/",
        "http://azure.example/",
    ],
)
def test_platform_addresses_are_refused_even_when_allowed(target: str) -> None:
    for allowlist in (ALLOW, BROAD):
        with pytest.raises(ProbeRefused, match="metadata"):
            allowlist.check(target)


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.1:8000",
        "http://2130706433:8000",  # 127.0.0.1 in decimal
        "http://0177.0.0.1:8000",  # octal
        "http://0x7f.0.0.1:8000",  # hex
        "http://127.1:8000",  # short form
        "http://[::1]:8000",
        "http://[::ffff:127.0.0.1]:8000",
        "http://localhost:8000",  # resolves offline, to loopback
        "http://0.0.0.0:8000",
        "http://outside.example:8000",
        "http://split.example:8000",  # one address outside the CIDRs is enough
    ],
)
def test_a_strict_allowlist_refuses_every_spelling_of_other_hosts(target: str) -> None:
    with pytest.raises(ProbeRefused):
        STRICT.check(target)


@pytest.mark.parametrize(
    "target, why",
    [
        ("http://outside.example:8000", "not in the probe allowlist"),
        ("http://vllm-3:9999", "not in the probe allowlist"),
        ("http://user:pw@10.0.0.1/", "credentials"),
        ("http://nowhere.invalid/", "cannot resolve"),
        ("http://[::]:8000/", "unspecified"),
    ],
)
def test_refused(target: str, why: str) -> None:
    for allowlist in (ALLOW,) if "allowlist" in why else (ALLOW, BROAD):
        with pytest.raises(ProbeRefused, match=why):
            allowlist.check(target)


@pytest.mark.parametrize(
    "target",
    [
        "file:///etc/passwd",
        "ftp://10.0.0.1/",
        "gopher://10.0.0.1:70/",
        "http://10.0.0.1:99999/",
        "http://10.0.0.1:port/",
        "http://" + "a" * 64 + ".svc.local/",  # a label over 63 characters
        "http://" + "a." * 130 + "svc.local/",  # a name over 253 characters
        "http://[::1:5/",
        "http://[10.0.0.1]/",  # brackets around an IPv4 address
        "http://[not-v6]:80/",
        "http://bad_host!.svc.local/",
        "http://ünïcode.svc.local/",
        "http:///metrics",
        "http://a..b.svc.local/",
    ],
)
def test_malformed_targets_are_invalid_not_refused(target: str) -> None:
    with pytest.raises(ProbeInvalid):
        BROAD.check(target)


def test_an_empty_allowlist_refuses_everything() -> None:
    with pytest.raises(ProbeRefused):
        Allowlist(resolver=resolver).check("http://10.0.0.1:8000")


def test_vetted_addresses_are_what_the_check_resolved() -> None:
    assert ALLOW.addresses("http://engine-0.internal:30000") == ["10.0.0.7"]
    with pytest.raises(ProbeRefused):
        ALLOW.addresses("http://sneaky.example/")
