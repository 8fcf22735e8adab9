"""Turn what a user names on the command line into Scrapes: URLs, files, recordings."""

from __future__ import annotations

import os
from typing import Iterator

from kvdiag.model import Scrape
from kvdiag.sources.files import read_path
from kvdiag.sources.recording import read_recording
from kvdiag.sources.scrape import scrape


def is_url(arg: str) -> bool:
    return "://" in arg or (not os.path.exists(arg) and ":" in arg)


def read_inputs(args: list[str], replay: list[str] | None = None, timeout: float = 10.0) -> Iterator[Scrape]:
    """One scrape per URL, every scrape of each recording, one per exposition file."""
    for path in replay or []:
        yield from read_recording(path)
    for arg in args:
        if is_url(arg):
            yield scrape(arg, timeout=timeout)
        elif os.path.exists(arg):
            yield from read_path(arg)
        else:
            raise FileNotFoundError(f"{arg}: no such file, and not a URL")
