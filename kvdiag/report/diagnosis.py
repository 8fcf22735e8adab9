"""Terminal view of diagnoses (rich): verdict, each check with its evidence, findings, remedies."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvdiag.model import Diagnosis
from kvdiag.report.terminal import Fitted

VERDICT_STYLE = {"critical": "bold white on red", "warning": "bold black on yellow", "info": "bold black on cyan", "none": "bold black on green"}
STATUS_STYLE = {"firing": "bold red", "ok": "green", "unknown": "yellow"}


def render(console: Console, diagnoses: Iterable[Diagnosis]) -> None:
    for d in diagnoses:
        console.print(panel(d))


def panel(d: Diagnosis) -> Panel:
    style = "bold white on magenta" if d.verdict.name == "unknown" else VERDICT_STYLE[d.verdict.severity]
    head = Text()
    role = f" ({d.role} instance)" if d.role in ("prefill", "decode") else ""
    head.append(f"{d.engine} {d.model or ''}{role}\n", style="dim")  # here, not in the title: a title is cut to one line
    head.append(f" {d.verdict.name} ", style=style)
    head.append(f"  {d.verdict.reason}")
    if d.verdict.name == "unknown" and d.checks and all(c.evidence.summary == d.verdict.reason for c in d.checks.values()):
        # nothing was read (down, not an engine): the reason once, not once per check and remedy
        return Panel(Group(head, Text("no check could run on this target", style="dim")), title=Text(d.instance), subtitle=_span(d), title_align="left")
    checks = Table(show_header=True, header_style="bold", expand=True, box=None)
    checks.add_column("check", no_wrap=True)
    checks.add_column("status", no_wrap=True)
    checks.add_column("evidence")
    for c in d.checks.values():
        detail = c.evidence.summary
        if c.status == "unknown" and c.hint:
            detail += f" [dim]({c.hint})[/dim]"
        checks.add_row(c.check, Text(c.status, style=STATUS_STYLE[c.status]), detail)
    parts: list = [head, Text(""), Fitted(checks)]
    if d.findings:
        parts.append(Text("\nfindings", style="bold"))
        parts.extend(Text(f"  • {f.name}: {f.text}") for f in d.findings)
    if d.remedies:
        parts.append(Text("\nremedies", style="bold"))
        parts.extend(Text(f"  • {r}") for r in d.remedies)
    for note in d.notes:
        parts.append(Text(f"note: {note}", style="dim"))
    return Panel(Group(*parts), title=Text(d.instance), subtitle=_span(d), title_align="left")


def _span(d: Diagnosis) -> str:
    if d.samples <= 1:
        return "one sample (point in time)" if d.samples == 1 else ""
    start = datetime.fromtimestamp(d.start, timezone.utc).strftime("%H:%M:%S")
    end = datetime.fromtimestamp(d.end, timezone.utc).strftime("%H:%M:%S UTC")
    return f"{d.samples} samples, {start}–{end}"
