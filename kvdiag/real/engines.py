"""Start, warm up and stop a real vLLM or SGLang server on loopback with a given pool and caps.

The flags and environment are the ones that work on a CPU-only machine with the tiny model
(facts/real-engines.md). Each server runs in its own process group, so ``stop`` ends the API
server and every child (vLLM's engine core and worker, SGLang's scheduler and detokenizer) with
one signal, and nothing outlives the ``with`` block or the interpreter (atexit). Its port is one
the kernel picked as free just before the start. The truth hook (kvdiag/real/site) appends the
scheduler's decisions to ``truth_path``.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from kvdiag.real import envs

SITE = Path(__file__).resolve().parent / "site"
SGLANG_SITE = Path(__file__).resolve().parent / "sglang_site"
TINY_MODEL = Path(__file__).resolve().parent / "tiny_model.py"
MODEL_NAME = "tiny"
WARMUP_PROMPT = "kvdiag warms the engine up with a prompt of a few dozen tokens."  # vLLM: never tiny first
START_TIMEOUT_S = 600.0  # a hang guard: 35-90 s on a loaded 2-core machine
_RUNNING: set["Engine"] = set()


@dataclass(frozen=True)
class EngineSpec:
    """One server's pool and caps. ``pool_tokens`` is exact on both engines (vLLM: blocks of
    ``block_size`` via --num-gpu-blocks-override; SGLang: --max-total-tokens at page size 1)."""

    engine: str  # "vllm" | "sglang"
    pool_tokens: int = 2048
    max_running: int = 16  # vLLM --max-num-seqs, SGLang --max-running-requests
    max_batched_tokens: int = 1024  # vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size
    context_len: int = 1024
    block_size: int = 32  # vLLM's CPU attention needs a multiple of 32
    env: tuple[tuple[str, str], ...] = ()  # extra environment (e.g. SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION)
    args: tuple[str, ...] = ()  # extra flags (a remedy's: --kv-cache-dtype, --schedule-conservativeness)

    def __post_init__(self) -> None:
        if self.engine not in envs.ENGINES:
            raise ValueError(f"unknown engine {self.engine!r} (one of {', '.join(envs.ENGINES)})")
        if self.engine == "vllm" and (self.pool_tokens % self.block_size or self.pool_tokens // self.block_size <= self.context_len // self.block_size):
            raise ValueError(f"vLLM's pool must be whole blocks of {self.block_size} and more than context_len / block_size blocks")

    def argv(self, python: Path, model: Path, port: int) -> list[str]:
        common = ["--served-model-name", MODEL_NAME, "--load-format", "dummy", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port)]
        if self.engine == "vllm":
            return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common,
                    "--enforce-eager", "--max-model-len", str(self.context_len), "--block-size", str(self.block_size),
                    "--num-gpu-blocks-override", str(self.pool_tokens // self.block_size), "--max-num-seqs", str(self.max_running),
                    "--max-num-batched-tokens", str(self.max_batched_tokens), "--enable-prefix-caching", *self.args]  # fmt: skip
        return [str(python), "-m", "sglang.launch_server", "--model-path", str(model), *common,
                "--device", "cpu", "--enable-metrics", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                "--grammar-backend", "none", "--disable-cuda-graph", "--skip-server-warmup", "--tp", "1",
                "--max-total-tokens", str(self.pool_tokens), "--max-running-requests", str(self.max_running),
                "--chunked-prefill-size", str(self.max_batched_tokens), "--page-size", "1", "--context-length", str(self.context_len),
                *self.args]  # fmt: skip

    def environment(self, truth: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "SGLANG_", "KVDIAG_"))}
        site = [str(SITE)] + ([str(SGLANG_SITE)] if self.engine == "sglang" else [])
        env.update(PYTHONPATH=os.pathsep.join(site), KVDIAG_TRUTH_FILE=str(truth), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
        if self.engine == "vllm":
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
        else:
            env.update(SGLANG_USE_CPU_ENGINE="1")
        env.update(self.env)
        return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)
class Engine:
    """A running server (``start`` / ``stop``, or ``with Engine(spec, workdir) as e``)."""

    spec: EngineSpec
    workdir: Path
    port: int = 0
    started_s: float = 0.0  # launch to warmed up
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def truth_path(self) -> Path:
        return self.workdir / "truth.jsonl"

    @property
    def log_path(self) -> Path:
        return self.workdir / "engine.log"

    def start(self, timeout: float = START_TIMEOUT_S) -> "Engine":
        python = envs.python(self.spec.engine)
        self.workdir.mkdir(parents=True, exist_ok=True)
        model = self.workdir / "model"
        subprocess.run([str(python), str(TINY_MODEL), str(model)], check=True)
        self.port = free_port()
        t0 = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.spec.argv(python, model, self.port), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.spec.environment(self.truth_path), start_new_session=True)  # fmt: skip
        _RUNNING.add(self)
        try:
            self._wait_healthy(t0 + timeout)
            self.warm_up()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.engine} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.engine} did not answer /health in time:\n{self.log_tail()}")
            time.sleep(1.0)

    def warm_up(self) -> None:
        """One request of a few dozen tokens (vLLM's CPU worker died on a tiny first prompt)."""
        r = requests.post(self.url + "/v1/completions", timeout=300,
                          json={"model": MODEL_NAME, "prompt": WARMUP_PROMPT, "max_tokens": 8, "ignore_eos": True})  # fmt: skip
        r.raise_for_status()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after 30 s; returns once
        the group is gone (or, for a member stuck past SIGKILL, after 10 s more)."""
        proc, self.proc = self.proc, None
        _RUNNING.discard(self)
        if proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while _group_alive(proc) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not _group_alive(proc):
                break
        proc.wait()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    proc.poll()  # reap the leader, or it stays in its group as a zombie
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


@atexit.register
def _stop_all() -> None:
    for engine in list(_RUNNING):
        engine.stop()
