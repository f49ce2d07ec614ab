"""The docs as a contract, the part that needs no cluster: every command a page shows has a case that runs it as
typed (tests/cluster/test_readme.py, tests/readme_quickstart.py, or a named elsewhere), the README stays short,
every page is on the site's nav, and no page keeps a dated timing (those belong to bench/README.md)."""

from __future__ import annotations

import ast
import re

import readme_quickstart
import yaml
from doccommands import RUN_ELSEWHERE, commands_of, doc_commands, pages

from conftest import REPO

CASES = REPO / "tests" / "cluster" / "test_readme.py"


def cases() -> set[str]:
    """The commands test_readme.py runs, by their text (adjacent string literals arrive joined)."""
    tree = ast.parse(CASES.read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_every_command_in_the_docs_has_a_case() -> None:
    """A command added to the README or a docs page without a case fails here, naming the page."""
    known = cases() | set(RUN_ELSEWHERE) | set(readme_quickstart.commands())
    missing = {c: where for c, where in doc_commands().items() if c not in known}
    assert missing == {}, f"commands without a case in {CASES.relative_to(REPO)}: {missing}"


def test_the_collector_finds_the_commands_of_every_fence_it_should() -> None:
    text = ("```bash\nhpcjobs a   # note\n# a comment\n\nhpcjobs b\n```\n"
            "```console\nhpcjobs c\n```\n```python\nhpcjobs d\n```\n```bash\n#!/bin/bash\nsrun x\n```\n")
    assert commands_of(text) == ["hpcjobs a", "hpcjobs b", "hpcjobs c"]


def test_the_readme_is_short_and_leads_to_the_docs() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    linked = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    missing = [p for p in linked if not (REPO / p).is_file()]
    assert linked and missing == []


def nav_pages(nav: list) -> list[str]:
    found: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def test_every_page_is_on_the_sites_nav_once() -> None:
    """mkdocs build --strict (tests/run_all.sh) says the same, with the links; this says it in a second."""
    nav = nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    on_disk = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md"))
    assert sorted(nav) == on_disk


def test_no_page_keeps_a_dated_result() -> None:
    """Dated benchmark results live in bench/README.md, CI's timings nowhere: a page states what is, undated."""
    dated = {str(p.relative_to(REPO)): re.findall(r"\b20\d\d-\d\d-\d\d\b", p.read_text()) for p in pages()}
    assert {p: d for p, d in dated.items() if d} == {}
