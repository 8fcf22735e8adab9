"""Local inputs: one saved exposition file, or a recording, told apart by their content
(``kvdiag.sources.series`` reads several exposition files as a series)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvdiag.model import Scrape


#: A recording line opens with one of its keys; an exposition may open with ``{`` too (the
#: quoted-name form ``{"sglang:num_running_reqs"} 3``), but never with ``{"key":``.
_RECORDING_HEAD = re.compile(rb'\{\s*"(?:ts|target|content_type|body)"\s*:')


def is_recording(path: str | Path) -> bool:
    """Recordings are gzip'd (or plain) JSON Lines; expositions are text."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    return head[:2] == b"\x1f\x8b" or _RECORDING_HEAD.match(head) is not None


def read_exposition_file(path: str | Path) -> Scrape:
    """A saved ``/metrics`` body; its modification time stands for the scrape time."""
    p = Path(path)
    data = p.read_bytes()
    try:
        body = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return Scrape(os.path.getmtime(p), str(p), None, body)
