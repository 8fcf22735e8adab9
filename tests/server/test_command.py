"""`kvdiag serve` end to end: the command starts, scrapes an engine, answers, and stops."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import requests

from kvdiag.refpool.serve import MetricsServer
from tests.server.conftest import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvdiag_serve_runs_with_flags_only(engines: dict[str, MetricsServer]) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "kvdiag", "serve", "--target", engines["sglang"].url, "--interval", "0.5s", "--window", "30s", "--listen", f"127.0.0.1:{port}", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"

    def answers(path: str) -> bool:
        try:
            return requests.get(base + path, timeout=5).status_code == 200
        except (requests.ConnectionError, requests.Timeout):  # bound but still starting
            return False

    try:
        assert wait_for(lambda: answers("/readyz")), proc.stdout.read() if proc.poll() is not None else "not ready"  # type: ignore[union-attr]
        assert wait_for(lambda: "kvdiag_verdict{" in requests.get(base + "/metrics", timeout=10).text)
        assert requests.get(base + "/", timeout=10).text.startswith("<!doctype html>")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode in (0, -signal.SIGINT)
    assert not answers("/healthz")
