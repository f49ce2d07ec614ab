"""The submit side's remaining bad inputs (issue 38 item 4): each is one line naming what was given, what is valid and
a HINT, exit code 2, before anything is queued or written (no run folder, no code snapshot, no job record).

tests/test_bad_inputs.py holds the earlier ones; these each got through, or got the wrong answer, before."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import REPO, hpcjobs
from test_bad_inputs import GOOD, assert_refused


@pytest.fixture
def sbatch_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from conftest import sbatch_shim

    log = tmp_path / "sbatch-calls.log"
    sbatch_shim(tmp_path, monkeypatch, f'echo "$@" >> {log}\nexit 1\n')
    return log


def nothing_left(where: Path) -> None:
    """No run folder, no code snapshot, no job record."""
    assert not (where / "runs").exists(), sorted(p.name for p in (where / "runs").iterdir())
    assert hpcjobs("list", "--json").stdout.strip() == "[]"


@pytest.mark.parametrize("entry", ["profiles", "profiles/"])
def test_a_folder_given_as_the_entry_is_refused(entry: str, tmp_path: Path, sbatch_log: Path) -> None:
    """`submit ... profiles` (a folder of YAML files, no package) was found as a namespace package: a rank started,
    failed with 'defines neither make_task nor task', exit 1, and left a run folder and a job record."""
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "mysite.yaml").write_text("scheduler: local\n")
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", entry, cwd=tmp_path)
    assert_refused(out, "'profiles' is a folder", sbatch_log)
    nothing_left(tmp_path)


@pytest.mark.parametrize("exists,fragment", [
    (True, "drop -m to run the script: `hpcjobs submit ... train.py`"),
    (False, "drop the .py: `-m train`"),
])
def test_m_with_a_file_name_gets_a_hint(exists: bool, fragment: str, tmp_path: Path, sbatch_log: Path) -> None:
    if exists:
        (tmp_path / "train.py").write_text("print('trains')\n")
    out = hpcjobs("submit", "--profile", "local", "-m", "train.py", cwd=tmp_path)
    assert_refused(out, fragment, sbatch_log)
    assert "-m takes a module name" in out.stderr


@pytest.mark.parametrize("flag", ["--run-dir", "--name"])
def test_an_empty_value_is_refused(flag: str, tmp_path: Path, sbatch_log: Path) -> None:
    """`--run-dir "$RUN"` with RUN unset was taken as no --run-dir: a user meaning to resume started over without a
    word. `--name ""` was accepted."""
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", flag, "", "trainers.tasks.lm", "--steps", "2",
                  cwd=tmp_path)
    assert_refused(out, f"{flag} '' is empty", sbatch_log)
    nothing_left(tmp_path)


def test_a_run_folder_the_system_cannot_make_is_one_line(tmp_path: Path, sbatch_log: Path) -> None:
    """Under /proc nothing can be made, root or not: it failed at the code snapshot, exit 1."""
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", "/proc/x/run", "trainers.tasks.lm",
                  "--steps", "2", cwd=tmp_path)
    assert_refused(out, "run folder /proc/x/run", sbatch_log)
    assert hpcjobs("list", "--json").stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["render", "submit"])
def test_an_unset_variable_in_runs_dir_is_refused(command: str, tmp_path: Path, sbatch_log: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`runs_dir: .../$USER/...` with USER unset stayed literal: render made a folder named `$USER`."""
    monkeypatch.delenv("USER", raising=False)
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({**GOOD, "runs_dir": str(tmp_path / "scratch") + "/$USER/runs"}))
    extra = ["-o", str(tmp_path / "job.sbatch")] if command == "render" else []
    out = hpcjobs(command, "--profile", str(prof), *extra, "trainers.tasks.lm", cwd=REPO)
    assert_refused(out, "$USER", sbatch_log)
    assert "USER is not set" in out.stderr
    assert not (tmp_path / "scratch").exists() and not (tmp_path / "job.sbatch").exists()


def test_a_mistyped_required_flag_gets_did_you_mean(sbatch_log: Path) -> None:
    """`--profil local` said only '--profile required'."""
    out = hpcjobs("submit", "--profil", "local", "trainers.tasks.lm", cwd=REPO)
    assert_refused(out, "did you mean --profile?", sbatch_log)
