"""Secrets (API and engine tokens, passwords) read from files, within bounds.

A secret file is a small regular file, as Kubernetes and Docker mount them. Anything else is
refused with what it is, before a byte is read: a FIFO with no writer would block start-up
forever (it is opened without blocking, then refused), ``/dev/zero`` or a huge file would be
read until memory runs out. A secret holds no control character: a newline inside a token
would end the ``Authorization`` header it is sent in and start another.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

#: The largest secret file read: tokens and passwords are far shorter (a JWT is a few KiB).
MAX_SECRET_BYTES = 64 * 1024
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def read_secret(path: Path) -> str:
    """The file's text without surrounding whitespace; ValueError naming the file and why it
    cannot be a secret (unreadable, not a regular file, too large, not UTF-8, empty)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        mode = os.fstat(fd)
        if not stat.S_ISREG(mode.st_mode):
            raise ValueError(f"{path}: {_kind(mode.st_mode)}, not a regular file: a secret is read from a file that holds it")
        if mode.st_size > MAX_SECRET_BYTES:
            raise ValueError(f"{path}: {mode.st_size} bytes; a secret file holds at most {MAX_SECRET_BYTES}")
        data = b""
        while len(data) <= MAX_SECRET_BYTES:
            chunk = os.read(fd, MAX_SECRET_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise ValueError(f"{path}: more than {MAX_SECRET_BYTES} bytes; a secret file holds at most that")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if not text:
        raise ValueError(f"{path}: the file is empty")
    return check_secret(text, str(path))


def check_secret(value: str, what: str) -> str:
    """``value`` when it can be sent as a secret; ValueError (never quoting it) otherwise."""
    if _CONTROL_RE.search(value):
        raise ValueError(f"{what}: the secret holds a line break or control character")
    return value


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"
