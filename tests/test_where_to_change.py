"""docs/design/where-to-change.md stays true (issue 36): every file or folder a row names exists, and every name it
puts in backticks beside them (a class, a function, a constant, a method) is found in one of that row's files.
A row that names a place that moved, or a symbol that was renamed, fails here instead of misleading a maintainer."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "design" / "where-to-change.md"
PATH = re.compile(r"^[\w.-]+(/[\w.<>-]*)+$")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\(\))?$")
NOT_CODE = {"NAME", "FINISHED", "OWN", "SHARDED", "HPCJOBS_HOOKS=0", "sbatch", "scheduler", "place", "reservation"}
"""Backticked words of the page that are not symbols: placeholders, file markers, profile keys and words."""


def rows() -> list[tuple[str, list[str]]]:
    found = []
    for line in PAGE.read_text().splitlines():
        if line.startswith("| ") and not line.startswith(("| change", "|---")):
            change, files = line.strip("|").split(" | ", 1)
            found.append((change.strip(), re.findall(r"`([^`]+)`", files)))
    return found


def test_every_row_names_places_that_exist_and_symbols_found_there() -> None:
    assert len(rows()) >= 10
    wrong = []
    for change, ticks in rows():
        paths = [t for t in ticks if PATH.match(t) and "NAME" not in t]
        wrong += [f"{change}: {p} does not exist" for p in paths if not (REPO / p.rstrip("/")).exists()]
        text = "".join((REPO / p).read_text() for p in paths if p.endswith(".py") and (REPO / p).is_file())
        for t in ticks:
            if t in NOT_CODE or PATH.match(t) or not NAME.match(t) or "." in t.rstrip("()"):
                continue
            if not re.search(rf"\b{re.escape(t.rstrip('()'))}\b", text):
                wrong.append(f"{change}: `{t}` is in none of {paths}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_moved_file_and_a_renamed_symbol(tmp_path: Path, monkeypatch: object) -> None:
    """The check above, on a made-up row: a file that is not there and a symbol its file does not hold."""
    import pytest

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    page = tmp_path / "w.md"
    page.write_text("| change | files |\n|---|---|\n| x | `hpcjobs/nowhere.py`; `NoSuchThing` in "
                    "`hpcjobs/protocol/states.py` |\n" * 10)
    monkeypatch.setattr(__import__(__name__), "PAGE", page)
    with pytest.raises(AssertionError, match="(?s)nowhere.py does not exist.*NoSuchThing"):
        test_every_row_names_places_that_exist_and_symbols_found_there()
