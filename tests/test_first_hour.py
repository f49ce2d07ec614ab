"""A new user's first hour (issue 10): the README's instructions work as typed, mistakes are refused cleanly."""

from __future__ import annotations

from pathlib import Path

from conftest import hpcjobs

MYTASK = '''
from trainers.task import Task

def make_task(args):
    raise SystemExit("only looked up at submit time in this test")
'''


def test_a_task_module_in_the_working_folder_is_found(tmp_path: Path) -> None:
    """The console script's sys.path lacks the working folder; the ranks' has it (they start with -m there)."""
    (tmp_path / "mytask.py").write_text(MYTASK)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("print('hi')\n")
    for entry in (["mytask", "--steps", "5"], ["mytask:make_task"], ["-m", "pkg.train"]):
        out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--dry-run", *entry, cwd=tmp_path)
        assert out.returncode == 0, (entry, out.stderr)
    out = hpcjobs("submit", "--profile", "local", "--dry-run", "notmytask", cwd=tmp_path)
    assert out.returncode == 2 and f"cannot be found from {tmp_path}" in out.stderr
