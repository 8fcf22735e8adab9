"""The /probe allowlist: listed hosts, CIDRs and a regex pass; everything else, and every
cloud metadata address however it is disguised, is refused."""

from __future__ import annotations

import pytest

from kvdiag.server.probe import Allowlist, ProbeRefused

FAKE_DNS = {
    "engine-0.internal": ["10.0.0.7"],
    "sneaky.example": ["169.254.169.254"],
    "v6meta.example": ["fd00:ec2::254"],
    "outside.example": ["203.0.113.9"],
    "split.example": ["10.0.0.8", "203.0.113.10"],
    "vllm-3": ["10.1.0.3"],
}


def resolver(host: str) -> list[str]:
    if host in FAKE_DNS:
        return FAKE_DNS[host]
    if host.replace(".", "").isdigit() or ":" in host:
        return [host]
    raise ProbeRefused(f"cannot resolve {host!r}")


ALLOW = Allowlist.build(
    hosts=["engine-0.internal", "sneaky.example", "*.svc.local"],
    cidrs=["10.0.0.0/16", "169.254.0.0/16"],
    regex=r"http://vllm-[0-9]+:8000(/metrics)?",
    resolver=resolver,
)


@pytest.mark.parametrize(
    "target",
    ["engine-0.internal:30000", "http://10.0.3.4:8000/metrics", "https://10.0.0.1", "http://vllm-3:8000"],
)
def test_allowed(target: str) -> None:
    assert ALLOW.check(target).startswith("http")


@pytest.mark.parametrize(
    "target, why",
    [
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[fd00:ec2::254]/latest", "metadata"),
        ("http://metadata.google.internal/computeMetadata/v1/", "metadata"),
        ("http://sneaky.example/", "169.254.169.254"),  # listed host, metadata address behind it
        ("http://v6meta.example/", "fd00:ec2::254"),
        ("http://[::ffff:169.254.169.254]/", "metadata"),
        ("http://outside.example:8000", "not in the probe allowlist"),
        ("http://split.example:8000", "not in the probe allowlist"),  # one address outside the CIDRs
        ("http://vllm-3:9999", "not in the probe allowlist"),
        ("file:///etc/passwd", "only http"),
        ("http://user:pw@10.0.0.1/", "credentials"),
        ("http://10.0.0.1:99999/", "not a URL"),
        ("http://nowhere.invalid/", "cannot resolve"),
    ],
)
def test_refused(target: str, why: str) -> None:
    with pytest.raises(ProbeRefused, match=why.replace("[", r"\[").replace(".", r"\.")):
        ALLOW.check(target)


def test_an_empty_allowlist_refuses_everything() -> None:
    with pytest.raises(ProbeRefused):
        Allowlist(resolver=resolver).check("http://10.0.0.1:8000")
