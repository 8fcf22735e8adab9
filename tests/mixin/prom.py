"""A real Prometheus (the Debian package's binary) for the mixin tests.

Started on 127.0.0.1 with a temporary data directory, a 1 s scrape and evaluation interval,
the given rule files and static loopback targets (each job with the given
``metric_relabel_configs``, e.g. kvdiag's keep-list); queried over its HTTP API. Every wait is
bounded and says what it waited for when it gives up. ``Process`` (any server on loopback,
ready when a URL answers 200) is what the deploy tests run the compose stack's services with.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, TypeVar

import requests
import yaml

from tests.conftest import hang_guard

T = TypeVar("T")
P = TypeVar("P", bound="Process")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A command serving on loopback, its output in ``log``; ready once ``ready_url`` answers
    200. ``stop`` terminates it and waits (kill after 15 s), so nothing outlives a test."""

    def __init__(self, argv: list[str], log: Path, ready_url: str) -> None:
        self.argv = argv
        self.log_path = log
        self.ready_url = ready_url
        self.log = log.open("w")
        self.proc: subprocess.Popen | None = None

    def start(self: P, timeout: float = hang_guard(10)) -> P:
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(self._ready, timeout, f"{Path(self.argv[0]).name} to answer {self.ready_url}")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}:\n{self.logs()}")
        try:
            return requests.get(self.ready_url, timeout=5).status_code == 200
        except (requests.ConnectionError, requests.Timeout):
            # Not answering yet (a bound port whose app is still starting on a busy machine
            # accepts the connection and says nothing): keep waiting until the start deadline.
            return False

    def logs(self, tail: int | None = 4000) -> str:
        """The process's output so far: its last ``tail`` characters, or all of it (None)."""
        self.log.flush()
        text = self.log_path.read_text()
        return text if tail is None else text[-tail:]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

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


class Prometheus(Process):
    def __init__(self, binary: str, workdir: Path, rule_files: list[Path], jobs: dict[str, str],
                 metric_relabel_configs: list[dict] | None = None, flags: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [url.split("//", 1)[1]]}],
                 **({"metric_relabel_configs": metric_relabel_configs} if metric_relabel_configs else {})}
                for job, url in jobs.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        argv = [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            *flags,
        ]
        super().__init__(argv, workdir / "prometheus.log", self.url + "/-/ready")

    def api(self, path: str, **params: str) -> dict:
        r = requests.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str, **params: str) -> list[dict]:
        return self.api("query", query=expr, **params)["result"]

    def own_metrics(self, family: str) -> dict[str, float]:
        """Prometheus' own /metrics samples of ``family`` (read directly, not scraped), keyed by
        their label text."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith(family + "{") or line.startswith(family + " "):
                key, _, value = line.rpartition(" ")
                out[key[len(family):]] = float(value)
        return out
