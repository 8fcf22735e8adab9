"""The exporter's config: a good file loads, a bad one is refused naming the line at fault."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvdiag.cli import build_parser
from kvdiag.commands import serve as serve_command
from kvdiag.config import ConfigError
from kvdiag.server import settings as serve_settings
from kvdiag.server.settings import DEFAULT_PORT
from kvdiag.server.targets import Shard

GOOD = """\
listen: 0.0.0.0:9999
api_bearer_token_file: token.txt
shard: 1/3
scrape:
  interval: 10s
  timeout: 4s
  concurrency: 16
  max_body_bytes: 1048576
  auth:
    basic: {username: kv, password: secret}
    ca_file: ca.pem
targets:
  - http://10.0.0.5:30000
  - {url: http://10.0.0.6:8000, labels: {cluster: east}}
file_sd: [sd/engines.json]
probe:
  hosts: [engine-0.internal]
  cidrs: [10.0.0.0/16]
  regex: 'http://vllm-[0-9]+:8000'
checks:
  window: 10m
  saturated_usage: 0.9
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvdiag.yaml"
    path.write_text(text)
    return path


def test_a_full_config_loads(tmp_path: Path) -> None:
    (tmp_path / "token.txt").write_text("s3cret\n")
    (tmp_path / "ca.pem").write_text("")
    s = serve_settings.load(write(tmp_path, GOOD))
    assert (s.host, s.port, s.api_token, s.shard) == ("0.0.0.0", 9999, "s3cret", Shard(1, 3))
    assert (s.scrape.interval, s.scrape.effective_timeout, s.scrape.concurrency, s.scrape.max_bytes) == (10.0, 4.0, 16, 1048576)
    assert s.scrape.auth is not None and s.scrape.auth.basic == ("kv", "secret")
    assert s.scrape.auth.ca_file == str(tmp_path / "ca.pem")
    assert [t.url for t in s.targets] == ["http://10.0.0.5:30000", "http://10.0.0.6:8000"]
    assert s.targets[1].label_dict == {"cluster": "east"}
    assert s.file_sd == (tmp_path / "sd/engines.json",)
    assert s.checks.window == 600 and s.checks.saturated_usage == 0.9
    assert s.probe.allowlist.hosts == {"engine-0.internal"}


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("targetz: [a:1]\n", 1, "unknown key 'targetz'"),
        ("scrape:\n  interval: 5s\n  timeout: soon\n", 3, "scrape.timeout"),
        ("scrape:\n  interval: 5s\n  timeout: 9s\n", 3, "exceeds the interval"),
        ("scrape:\n  concurrency: -2\n", 2, "concurrency must be positive"),
        ("targets:\n  - http://a:1\n  - {url: http://b:1, labels: {instance: x}}\n", 3, "set by kvdiag itself"),
        ("targets:\n  - http://a:1\n  - 42\n", 3, "targets[1]"),
        ("probe:\n  hosts: [a]\n  cidrs: [10.0.0.0/33]\n", 3, "not a CIDR"),
        ("probe:\n  regex: '(unclosed'\n", 1, "does not compile"),
        ("listen: nowhere\n", 1, "expected HOST:PORT"),
        ("shard: 3/3\n", 1, "0 <= I < N"),
        ("scrape:\n  auth:\n    basic: {password: x}\n", 3, "needs a username"),
        ("checks:\n  saturated_usage: 2\n", 2, "not a ratio"),
        ("window: 5m\n", 1, "belongs under 'checks:'"),
    ],
)
def test_a_bad_config_names_the_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        serve_settings.load(write(tmp_path, text))
    assert f"kvdiag.yaml:{line}:" in str(err.value)
    assert words in str(err.value)


def args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_flags_without_a_config_file() -> None:
    s = serve_command.resolve(args("--target", "http://a:8000", "--target", "b:30000", "--interval", "15s", "--window", "10m", "--listen", ":9000", "--shard", "0/2"))
    assert [t.url for t in s.targets] == ["http://a:8000", "b:30000"]
    assert (s.scrape.interval, s.scrape.effective_timeout, s.checks.window) == (15.0, 10.0, 600.0)
    assert (s.host, s.port, s.shard) == ("127.0.0.1", 9000, Shard(0, 2))


def test_defaults_listen_on_loopback_at_the_documented_port() -> None:
    s = serve_command.resolve(args())
    assert (s.host, s.port) == ("127.0.0.1", DEFAULT_PORT)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "targets: [http://a:1]\nscrape: {interval: 5s}\nchecks: {window: 5m}\n")
    s = serve_command.resolve(args("--config", str(path), "--target", "http://b:1", "--interval", "20s", "--window", "15m"))
    assert [t.url for t in s.targets] == ["http://a:1", "http://b:1"]
    assert (s.scrape.interval, s.checks.window) == (20.0, 900.0)


def test_the_command_refuses_a_bad_config_before_listening(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "scrape:\n  interval: fast\n")
    assert serve_command.run(args("--config", str(path))) == serve_command.EXIT_ERROR
    assert "kvdiag.yaml:2: scrape.interval" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("targets:\n", 1, "targets must be a list"),
        ("scrape:\n  interval: .nan\n", 2, "not a finite duration"),
        ("scrape:\n  interval: .inf\n", 2, "not a finite duration"),
        ("checks:\n  window: .inf\n", 2, "not a finite duration"),
        ("checks:\n  saturated_usage: .nan\n", 2, "not a finite number"),
        ("targets:\n  - ftp://10.0.0.5:21\n", 2, "only http:// and https://"),
        ("targets:\n  - file:///etc/passwd\n", 2, "only http:// and https://"),
        ("targets:\n  - http://10.0.0.5:99999\n", 2, "the port is not a number from 1 to 65535"),
        ("scrape:\n  auth:\n    ca_file: missing.pem\n", 3, "no such file"),
        ("listen: '[::1:5'\n", 1, "expected HOST:PORT"),
        ("scrape:\n  concurrency: 100000000\n", 2, "more than"),
        ("probe:\n  auth:\n    - {bearer_token: t}\n", 3, "names the hosts"),
        ("a:\n" + "".join("  " * i + "- \n" for i in range(1, 40)), 17, "nested more than"),
    ],
)
def test_every_bad_value_is_one_line_and_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, words: str) -> None:
    path = write(tmp_path, text)
    assert serve_command.run(args("--config", str(path))) == serve_command.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"kvdiag.yaml:{line}:" in err and words in err, err


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kvdiag.yaml"
    path.write_bytes(b"targets: [http://a:1]\n# caf\xe9\n")
    assert serve_command.run(args("--config", str(path))) == serve_command.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not UTF-8" in err


@pytest.mark.parametrize("listen", ["[::1:5", "::1:5", "[127.0.0.1]:80", "host name:80", "127.0.0.1:0", "127.0.0.1:65536"])
def test_bad_listen_flags(listen: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_command.run(args("--listen", listen)) == serve_command.EXIT_ERROR
    assert "expected HOST:PORT" in capsys.readouterr().err


def test_listen_accepts_v6_and_names() -> None:
    assert serve_command.resolve(args("--listen", "[::1]:9000")).host == "::1"
    assert serve_command.resolve(args("--listen", "localhost:9000")).host == "localhost"


def test_a_busy_port_is_one_error_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert serve_command.run(args("--listen", f"127.0.0.1:{port}")) == serve_command.EXIT_ERROR
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "startup complete" not in err and err.count("\n") == 1


def test_listening_beyond_loopback_without_a_token_is_said_loudly() -> None:
    from dataclasses import replace

    warning = serve_command.exposure_warning(serve_command.resolve(args("--listen", "0.0.0.0:9000")))
    assert warning is not None and "WITHOUT an API token" in warning and "0.0.0.0" in warning
    for listen in ("127.0.0.1:9000", "[::1]:9000", "localhost:9000", ":9000"):
        assert serve_command.exposure_warning(serve_command.resolve(args("--listen", listen))) is None, listen
    exposed = serve_command.resolve(args("--listen", "10.0.0.5:9000"))
    assert serve_command.exposure_warning(replace(exposed, api_token="t")) is None
