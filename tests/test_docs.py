"""The documentation's commands are the command line's: every ``megatron-dynapipe`` command in a
fenced block of the README, docs/ and patches/README.md parses with today's flags (a renamed or
removed flag fails here, not in a user's shell). The README's own examples also run as written
(tests/test_cli.py)."""

import re
import shlex

import pytest

from megatron_dynapipe.cli import build_parser
from project import ROOT

DOCUMENTS = [ROOT / "README.md", ROOT / "patches" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for each ``megatron-dynapipe`` command of a fenced block: continued lines
    joined, comments dropped; a command with a placeholder (``...``, ``<args>``) is left out."""
    found = []
    for path in DOCUMENTS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
            command = ""
            for line in block.splitlines():
                line = "" if line.lstrip().startswith("#") else line.split(" #")[0].rstrip()
                if line.endswith("\\"):
                    command += line[:-1] + " "
                    continue
                command, done = "", (command + line).strip()
                if done.startswith("megatron-dynapipe ") and "..." not in done and "<" not in done:
                    found.append((str(path.relative_to(ROOT)), done))
    return found


def test_the_documents_hold_commands():
    files = {path for path, _ in documented_commands()}
    assert {"README.md", "docs/profiling.md", "docs/tracing.md", "docs/simulate.md"} <= files, files


@pytest.mark.parametrize("path, command", documented_commands())
def test_every_documented_command_parses_with_todays_flags(path, command, capsys):
    try:
        build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit:
        pytest.fail(f"{path}: `{command}` no longer parses: {capsys.readouterr().err.strip()}")
