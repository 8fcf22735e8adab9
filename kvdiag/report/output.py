"""Where a report file goes: checked before the work that fills it.

``diagnose --html`` and ``whatif --html`` run minutes of sampling, replays or simulations
before they write; a report path in a folder that does not exist, or one that is a folder,
found only then is that work lost. The check is on the path (its folder exists, is writable,
and the path is not a folder), without creating the file, so a run that fails for another
reason leaves nothing behind.
"""

from __future__ import annotations

import os
from pathlib import Path


def check_writable(path: str, flag: str) -> None:
    """ValueError naming ``flag`` when a file cannot be written at ``path``."""
    p = Path(path)
    folder = p.parent
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: no such folder {str(folder)!r}")
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")
