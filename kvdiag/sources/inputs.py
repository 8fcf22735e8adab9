"""Turn what a user names on the command line into Scrapes: URLs, files, recordings."""

from __future__ import annotations

import os
from typing import Iterator

from kvdiag.model import Scrape
from kvdiag.sources.recording import read_recording
from kvdiag.sources.scrape import scrape
from kvdiag.sources.series import Note, read_files


def is_url(arg: str) -> bool:
    return "://" in arg or (not os.path.exists(arg) and ":" in arg)


def read_inputs(args: list[str], replay: list[str] | None = None, timeout: float = 10.0, note: Note = lambda _: None) -> Iterator[Scrape]:
    """One scrape per URL, every scrape of each recording, and the exposition files named (or in
    the folders named) as series of one target each (``kvdiag.sources.series``; ``note`` hears
    how each series was timed)."""
    for path in replay or []:
        yield from read_recording(path)
    for arg in args:
        if is_url(arg):
            yield scrape(arg, timeout=timeout)
    yield from read_files([a for a in args if not is_url(a)], note)
