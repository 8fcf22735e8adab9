"""The CLI answers at once: a command imports only what it uses.

Behaviour, not timing (``bench/bench_cli.py`` times it): each case runs the CLI in a fresh
interpreter and lists the modules it loaded. pandas, FastAPI / uvicorn and the reference pool take
a second or more to import; ``kvdiag --help`` and a one-file ``inspect`` need none of them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.cli import COMMANDS, build_parser
from tests.conftest import VLLM_FIXTURE, shared_fixture

ROOT = Path(__file__).resolve().parents[1]
#: Modules whose import alone costs a CLI its prompt answer.
HEAVY = ("pandas", "fastapi", "uvicorn", "starlette", "kvdiag.refpool", "kvdiag.window", "kvdiag.whatif")
#: A hang guard, sized for a machine ten times slower than the 2-core one this runs on.
HANG_GUARD_S = 120

_PROBE = """
import json, sys
from kvdiag.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def _loaded(*argv: str) -> tuple[int, set[str]]:
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return report["code"], set(report["modules"])


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_help_imports_no_command_and_nothing_heavy() -> None:
    code, modules = _loaded("--help")
    assert code == 0
    assert _heavy(modules) == []
    assert "numpy" not in modules and "rich" not in modules
    assert sorted(m for m in modules if m.startswith("kvdiag.commands.")) == []


def test_one_file_inspect_imports_nothing_heavy() -> None:
    code, modules = _loaded("inspect", "--json", str(shared_fixture(VLLM_FIXTURE)))
    assert code == 0
    assert _heavy(modules) == []
    assert "numpy" not in modules
    assert sorted(m for m in modules if m.startswith("kvdiag.commands.")) == ["kvdiag.commands.inspect"]


def test_a_command_imports_what_it_uses() -> None:
    """The lazy parser still hands each command its own options: ``diagnose --help`` loads
    diagnose (and the window it builds), not the exporter."""
    code, modules = _loaded("diagnose", "--help")
    assert code == 0
    assert "kvdiag.commands.diagnose" in modules and "pandas" in modules
    assert "fastapi" not in modules and "kvdiag.commands.serve" not in modules


def test_help_lists_every_command_with_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(["--help"]).parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name, summary in COMMANDS.items():
        assert f"{name} {' '.join(summary.split())}" in out


def test_every_command_is_a_module_with_its_parser() -> None:
    """Built eagerly (as tests and docs do), every command of the table parses its own options."""
    parser = build_parser()
    for name in COMMANDS:
        args = parser.parse_args([name, *_minimal_args(name)])
        assert args.command == name and callable(args._run)


def _minimal_args(name: str) -> list[str]:
    return {"record": ["http://127.0.0.1:1", "--out", "r.jsonl.gz"], "capacity": ["--model", "llama-3-8b"]}.get(name, [])


def test_no_module_below_the_commands_imports_one() -> None:
    """Data flows one way: the exporter, the reports and the sources never import a command."""
    offenders = []
    for path in (ROOT / "kvdiag").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kvdiag/commands/") or rel in ("kvdiag/cli.py", "kvdiag/__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "kvdiag.commands" or n.startswith("kvdiag.commands.") or n == "kvdiag.cli" for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []
