"""One scrape against real loopback servers: one deadline for all of it, whatever the target
does; redirects as engines send them; gzip within the cap; credentials never named."""

from __future__ import annotations

import gzip
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Callable, Iterator

import pytest

from kvdiag.sources.scrape import Auth, ScrapeError, next_due, redact, scrape, split_userinfo
from tests.server.conftest import Handle, reply

BODY = b"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3\n"


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def dripper(head: bytes, tail: bytes, sent: list[int], stop: threading.Event) -> Handle:
    """Sends ``head`` at once, then ``tail`` one byte every 50 ms, counting what went out."""

    def handle(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(head)
        h.wfile.flush()
        for i in range(len(tail)):
            if stop.wait(0.05):
                return
            h.wfile.write(tail[i : i + 1])
            h.wfile.flush()
            sent.append(1)

    return handle


@pytest.mark.parametrize(
    "head, tail, phase",
    [
        (b"", b"HTTP/1.1 200 OK\r\n\r\n" + BODY, "headers"),  # drips its status line
        (b"HTTP/1.1 200 OK\r\n", b"X-Slow: " + b"a" * 4000 + b"\r\n\r\n" + BODY, "headers"),
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n", BODY * 60, "body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"".join(b"1\r\n" + bytes([c]) + b"\r\n" for c in BODY * 20), "body"),
    ],
)
def test_one_deadline_bounds_the_whole_scrape(raw_server: Callable[[Handle], str], stop: threading.Event, head: bytes, tail: bytes, phase: str) -> None:
    sent: list[int] = []
    url = raw_server(dripper(head, tail, sent, stop))
    with pytest.raises(ScrapeError, match=rf"timed out after 0\.5s in all \(during the {phase}\)"):
        scrape(url, timeout=0.5)
    stop.set()
    # a per-read timeout waits for every byte (over 2 minutes of dripping here); the deadline
    # stops after about 10 of them (the bound leaves a loaded machine 10x the slack)
    assert len(sent) < min(len(tail), 100), len(sent)


def test_a_target_that_never_answers_and_one_that_refuses(raw_server: Callable[[Handle], str], stop: threading.Event) -> None:
    url = raw_server(lambda h: stop.wait(30))
    with pytest.raises(ScrapeError, match="timed out after 0.3s in all"):
        scrape(url, timeout=0.3)
    with pytest.raises(ScrapeError, match="connection refused"):
        scrape("http://127.0.0.1:9", timeout=2)


def test_redirects_as_engines_send_them(raw_server: Callable[[Handle], str]) -> None:
    seen: list[tuple[str, str | None]] = []

    def other(h: BaseHTTPRequestHandler) -> None:
        seen.append((h.path, h.headers.get("Authorization")))
        reply(h, 200, BODY)

    elsewhere = raw_server(other)

    def mounted(h: BaseHTTPRequestHandler) -> None:  # Starlette's Mount("/metrics"): 307 to /metrics/
        seen.append((h.path, h.headers.get("Authorization")))
        if h.path == "/metrics":
            h.send_response(307)
            h.send_header("Location", "/metrics/")
            h.send_header("Content-Length", "0")
            h.end_headers()
        elif h.path == "/away":
            h.send_response(302)
            h.send_header("Location", elsewhere + "/metrics")
            h.send_header("Content-Length", "0")
            h.end_headers()
        else:
            reply(h, 200, BODY)

    url = raw_server(mounted)
    got = scrape(url, timeout=5, auth=Auth(bearer="T"))
    assert got.body == BODY.decode() and got.target == url
    assert seen == [("/metrics", "Bearer T"), ("/metrics/", "Bearer T")]
    seen.clear()
    with pytest.raises(ScrapeError, match="redirect to .*/metrics' refused: kvdiag follows redirects within the target's own scheme, host and port"):
        scrape(url + "/away", timeout=5, auth=Auth(bearer="T"))
    assert seen == [("/away", "Bearer T")]  # another port is another origin: never contacted
    with pytest.raises(ScrapeError, match="redirect to /metrics/|redirect to http"):
        scrape(url, timeout=5, redirects=0)


def test_gzip_is_read_and_a_gzip_bomb_is_refused(raw_server: Callable[[Handle], str]) -> None:
    def gz(payload: bytes) -> Handle:
        packed = gzip.compress(payload)
        return lambda h: (h.send_response(200), h.send_header("Content-Encoding", "gzip"), h.send_header("Content-Length", str(len(packed))), h.end_headers(), h.wfile.write(packed))

    assert scrape(raw_server(gz(BODY)), timeout=5).body == BODY.decode()
    bomb = raw_server(gz(b"0" * (64 << 20)))  # 64 MiB of zeros in about 64 KiB
    with pytest.raises(ScrapeError, match="exceeds the 1048576-byte cap"):
        scrape(bomb, timeout=10, max_bytes=1 << 20)


def test_credentials_in_the_url_are_sent_and_never_named(raw_server: Callable[[Handle], str]) -> None:
    auth: list[str | None] = []

    def handle(h: BaseHTTPRequestHandler) -> None:
        auth.append(h.headers.get("Authorization"))
        reply(h, 500 if len(auth) > 1 else 200, BODY)

    url = raw_server(handle)
    secret = url.replace("http://", "http://kv:s3cr%40t@")
    got = scrape(secret, timeout=5)
    assert auth == ["Basic a3Y6czNjciU0MHQ="] and got.target == url  # kv:s3cr%40t, as written
    with pytest.raises(ScrapeError) as err:
        scrape(secret, timeout=5)
    assert "s3cr" not in str(err.value) and url in str(err.value)
    assert redact("kv:pw@h:1") == "h:1" and split_userinfo("http://h:1") == ("http://h:1", None)


@pytest.mark.parametrize("target, words", [("ftp://127.0.0.1/", "only http"), ("http://127.0.0.1:99999/", "port"), ("http://127.0.0.1:0/", "port"), ("http://127.0.0.1/a b", "spaces")])
def test_unscrapable_urls_are_errors_not_tracebacks(target: str, words: str) -> None:
    with pytest.raises(ScrapeError, match=words):
        scrape(target, timeout=1)


@pytest.fixture
def tls_server(tmp_path, stop: threading.Event) -> Iterator[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """An HTTPS engine on loopback with a self-signed certificate for 127.0.0.1 (made by the
    openssl CLI), and the certificate's path to trust it by."""
    import shutil
    import ssl
    import subprocess
    from http.server import ThreadingHTTPServer

    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed (Debian's openssl package)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            reply(self, 200, BODY)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}", str(cert)
    server.shutdown()
    server.server_close()


def test_https_with_a_ca_file_and_without(tls_server: tuple[str, str]) -> None:
    url, cert = tls_server
    assert scrape(url, timeout=10, auth=Auth(ca_file=cert)).body == BODY.decode()
    assert scrape(url, timeout=10, auth=Auth(insecure=True)).body == BODY.decode()
    with pytest.raises(ScrapeError, match="TLS"):
        scrape(url, timeout=10)  # the system store does not know a self-signed certificate


def test_a_tls_handshake_that_never_comes_is_bounded_too(stop: threading.Event) -> None:
    with socket.socket() as listener:  # accepts TCP, never says a word of TLS
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        url = f"https://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(ScrapeError, match=r"timed out after 0\.3s in all \(during the TLS handshake\)"):
            scrape(url, timeout=0.3)


def test_a_cadence_skips_the_slots_a_slow_scrape_missed() -> None:
    """A scrape due at 0 that ended at 32 s (a stalled target, a starved process) is followed by
    the next slot of the same phase, 35 s: not by the six it missed, one after another. The real
    harness caught those up on a loaded machine, six scrapes 20 ms apart, and the engine read as
    idle between them."""
    assert next_due(0.0, 32.4, 5.0) == 35.0
    assert next_due(10.0, 10.3, 5.0) == 15.0  # on time: the next slot
    assert next_due(10.0, 15.0, 5.0) == 20.0  # ended on a slot: that one is missed too, not doubled
    assert next_due(10.0, 9.0, 5.0) == 15.0  # a clock read before the due time never goes back
