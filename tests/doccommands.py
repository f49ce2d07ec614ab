"""The commands a user would type, as the README and the docs pages show them: every line of their fenced shell
blocks (comments dropped; the rendered job script, which sbatch runs, excepted). tests/test_docs.py checks that each
has a case (tests/cluster/test_readme.py runs them on the test cluster; the few run elsewhere are named here), so a
command added to a page without one fails there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHELL_FENCES = ("bash", "sh", "shell", "console")  # a block in any of these holds commands
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)

# Commands run by something other than tests/cluster/test_readme.py, and what runs them.
RUN_ELSEWHERE = {
    "bash tests/run_all.sh": "CI (.ci/run); it runs tests/cluster/test_readme.py itself",
    "bash tests/fast.sh": "no test: the fast tier runs a subset of what run_all.sh runs (running it there too would "
                          "only repeat those tests)",
}


def pages() -> list[Path]:
    """README.md, then every page of the site (docs/), in a fixed order."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def shell_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in SHELL_FENCES and not body.startswith("#!")]


def commands_of(text: str) -> list[str]:
    """Each command line of the text's shell blocks, its trailing comment dropped."""
    commands = []
    for block in shell_blocks(text):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def doc_commands() -> dict[str, list[str]]:
    """Every command of every page, with the pages that show it (relative paths)."""
    found: dict[str, list[str]] = {}
    for page in pages():
        for command in commands_of(page.read_text()):
            found.setdefault(command, []).append(str(page.relative_to(REPO)))
    return found


def python_block(first_line: str, lang: str = "python") -> str:
    """The one block of the docs in `lang` that starts with `first_line` (e.g. "# mytask.py")."""
    blocks = {body for page in pages() for fence, body in FENCE.findall(page.read_text())
              if fence == lang and body.startswith(first_line)}
    assert len(blocks) == 1, f"{len(blocks)} different {lang} blocks start with {first_line!r} in the docs"
    return blocks.pop()
