"""Issue 30, items 4 and 9: token keys that are empty, lists or given twice are errors, and
secret files are read within bounds (a FIFO with no writer, /dev/zero, a huge file)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.config import ConfigError
from kvdiag.server.secretfile import MAX_SECRET_BYTES, read_secret
from tests.server.conftest import load_config

HANG_GUARD_S = 120


@pytest.mark.parametrize(
    "text, words",
    [
        ("api_bearer_token:\n", "api_bearer_token is empty"),
        ("api_bearer_token: ''\n", "api_bearer_token is empty"),
        ("api_bearer_token_file:\n", "api_bearer_token_file is empty"),
        ("api_bearer_token: [a, b]\n", "api_bearer_token must be a string"),
        ("api_bearer_token: {a: b}\n", "api_bearer_token must be a string"),
        ("api_bearer_token_file: [a]\n", "api_bearer_token_file is not a file name"),
        ("api_bearer_token: one\napi_bearer_token_file: token\n", "give api_bearer_token or api_bearer_token_file, not both"),
        ("api_bearer_token_file: token\napi_bearer_token: one\n", "give api_bearer_token or api_bearer_token_file, not both"),
        ('api_bearer_token: "a\\nX-Injected: 1"\n', "line break or control character"),
        ("scrape:\n  auth: {bearer_token: }\n", "bearer_token is empty"),
        ("scrape:\n  auth: {bearer_token: [x]}\n", "bearer_token must be a string"),
        ("scrape:\n  auth: {bearer_token: x, bearer_token_file: token}\n", "not both"),
        ("probe:\n  hosts: [h]\n  auth:\n    - {hosts: [h], bearer_token_file: }\n", "bearer_token_file is empty"),
    ],
)
def test_a_token_key_that_is_not_one_token_is_refused(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "token").write_text("file-token\n")
    with pytest.raises(ConfigError, match=words):
        load_config(tmp_path, text)


def test_good_tokens_still_load(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("  file-token\n")
    assert load_config(tmp_path, "api_bearer_token_file: token\n").api_token == "file-token"
    assert load_config(tmp_path, "api_bearer_token: inline\n").api_token == "inline"
    assert load_config(tmp_path, "listen: 127.0.0.1:10877\n").api_token is None


def test_secret_files_that_are_not_small_regular_files(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="a FIFO \\(named pipe\\), not a regular file"):
        read_secret(fifo)  # opened without blocking: no writer needed to be refused
    with pytest.raises(ValueError, match="a device, not a regular file"):
        read_secret(Path("/dev/zero"))
    with pytest.raises(ValueError, match="a directory"):
        read_secret(tmp_path)
    huge = tmp_path / "huge"
    with open(huge, "wb") as fh:
        fh.truncate(10 << 30)  # 10 GiB, sparse
    with pytest.raises(ValueError, match=f"10737418240 bytes; a secret file holds at most {MAX_SECRET_BYTES}"):
        read_secret(huge)
    for name, data, words in (("empty", b" \n", "the file is empty"), ("latin1", b"\xe9t\xe9", "not UTF-8"), ("nl", b"a\nb", "line break")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=words):
            read_secret(tmp_path / name)
    with pytest.raises(ValueError, match="cannot read"):
        read_secret(tmp_path / "missing")


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # an unbounded read fails fast, not the machine


@pytest.mark.parametrize("make", ["fifo", "zero"])
def test_serve_refuses_such_a_token_file_at_once(tmp_path: Path, make: str) -> None:
    """The reproductions: ``api_bearer_token_file`` a FIFO with no writer (start-up blocked
    forever) or ``/dev/zero`` (read until MemoryError): exit 3 with the reason."""
    token = tmp_path / "token"
    if make == "fifo":
        os.mkfifo(token)
    else:
        token.symlink_to("/dev/zero")
    config = tmp_path / "kvdiag.yaml"
    config.write_text(f"api_bearer_token_file: {token}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvdiag", "serve", "--config", str(config)],
        capture_output=True, text=True, timeout=HANG_GUARD_S, preexec_fn=_limited,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "not a regular file" in proc.stderr and "Traceback" not in proc.stderr
