"""A real Prometheus (the Debian package's binary) for the mixin tests.

Started on 127.0.0.1 with a temporary data directory, a 1 s scrape and evaluation interval,
the given rule files and static loopback targets; queried over its HTTP API. Every wait is
bounded and says what it waited for when it gives up.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, TypeVar

import requests
import yaml

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, binary: str, workdir: Path, rule_files: list[Path], jobs: dict[str, str]) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [url.split("//", 1)[1]]}]} for job, url in jobs.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "Prometheus":
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.wait(lambda: self._ready(), timeout, "Prometheus to become ready")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.logs()}")
        try:
            return requests.get(self.url + "/-/ready", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False

    def logs(self) -> str:
        self.log.flush()
        return (self.workdir / "prometheus.log").read_text()[-4000:]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def api(self, path: str, **params: str) -> dict:
        r = requests.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    @staticmethod
    def wait(predicate: Callable[[], T], timeout: float, what: str, every: float = 0.5) -> T:
        deadline = time.monotonic() + timeout
        while True:
            got = predicate()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up after {timeout:.0f}s waiting for {what}")
            time.sleep(every)
