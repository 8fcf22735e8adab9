"""The documentation a newcomer reads: a README short enough to read to the end, every command
option documented in docs/reference.md, and no link that leads nowhere."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvdiag.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 12 * 1024


def _sections(text: str) -> dict[str, str]:
    """Each ``### kvdiag NAME`` section of the reference, by command name."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^### kvdiag (\w+)\n(.*?)(?=^##)", text + "\n##", re.S | re.M)}


def test_the_readme_reads_in_five_minutes() -> None:
    assert len((ROOT / "README.md").read_bytes()) < README_MAX_BYTES
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_every_command_and_option_is_in_the_reference() -> None:
    sections = _sections((ROOT / "docs" / "reference.md").read_text())
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = {}
    for name in COMMANDS:
        text = sections.get(name)
        assert text is not None, f"docs/reference.md has no '### kvdiag {name}' section"
        options = {o for a in commands.choices[name]._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        missing[name] = sorted(o for o in options if not re.search(re.escape(o) + r"(?![\w-])", text))
    assert {k: v for k, v in missing.items() if v} == {}


def test_every_link_in_the_docs_leads_somewhere() -> None:
    dead = []
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                dead.append(f"{page.relative_to(ROOT)} -> {target}")
    assert dead == []
