"""A bundled task's flags, a sweep's keys and the trackers' packages are checked before anything is queued or
created (issue 26, item 4): each case exits 2 with one line naming what is valid, sbatch is never called and no run
folder or job record is made. The parsers are the ones the tasks run on their ranks
(hpcjobs.protocol.settings.taskflags)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs, sbatch_shim
from hpcjobs.protocol.settings.taskargs import Number, TaskArgError
from hpcjobs.protocol.settings.taskflags import BUNDLED

CASES = [
    (["trainers.tasks.lm", "--size", "huge"], "--size: invalid choice: 'huge'; valid: --size 1b|7b|large|medium|"
                                               "small|tiny"),
    (["trainers.tasks.lm", "--foo"], "--foo is not a flag of this task or of the trainer; valid task flags: "
                                      "--dropout --samples --seq-len --size --text; trainer flags: --steps "),
    (["trainers.tasks.lm", "--foo", "3"], "--foo 3 is not a flag of this task or of the trainer"),
    (["trainers.tasks.lm", "--size"], "--size: expected one argument; valid: --size 1b|7b|"),
    (["trainers.tasks.lm", "--seq-len", "-1"], "--seq-len: -1 is out of range; valid: --seq-len N with N ≥ 1"),
    (["trainers.tasks.lm", "--dropout", "1.5"], "--dropout: 1.5 is out of range; valid: --dropout X with 0 ≤ X < 1"),
    (["trainers.tasks.lm", "--stesp", "5"], "HINT: did you mean --steps (a trainer flag)?"),
    (["--sweep", "lrr=1e-3,3e-3", "trainers.tasks.lm"], "--lrr 1e-3 is not a flag of this task or of the trainer"),
    (["trainers.tasks.lora", "--targets", "qkv,nope"], "--targets qkv,nope: 'nope' is not a Linear layer"),
    (["trainers.tasks.lora", "--rank", "4096"], "--rank 4096 is out of range; valid: --rank R with 1 ≤ R ≤ 64"),
    (["trainers.tasks.lm", "--strategy", "fsdp", "--replicate-degree", "2"],
     "--replicate-degree 2 with 1 rank(s); valid: a divisor of 1 below it"),
    (["trainers.tasks.classifier", "--hidden", "x"], "--hidden: 'x' is not a whole number; valid: --hidden N with"),
]


@pytest.fixture
def sbatch_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "sbatch-calls.log"
    sbatch_shim(tmp_path, monkeypatch, f'echo "$@" >> {log}\nexit 1\n')
    return log


@pytest.mark.parametrize("argv,fragment", CASES, ids=[" ".join(a) for a, _ in CASES])
@pytest.mark.parametrize("profile", ["testcluster", "local"])
def test_a_flag_the_task_would_refuse_is_refused_before_the_queue(argv: list[str], fragment: str, profile: str,
                                                                 tmp_path: Path, sbatch_log: Path) -> None:
    run, home = tmp_path / "run", tmp_path / "home"
    out = hpcjobs("submit", "--profile", profile, "--nodes", "1", "--gpus", "1", "--run-dir", str(run), *argv,
                  cwd=REPO, env={"HPCJOBS_HOME": str(home)})
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "HINT:" in lines[0], out.stderr
    assert not sbatch_log.exists(), "sbatch was called"
    assert not run.exists() and not home.exists(), "a refused job wrote something"


def test_a_tracker_whose_package_the_ranks_lack_is_refused_before_the_queue(tmp_path: Path,
                                                                            sbatch_log: Path) -> None:
    # A venv without tensorboard stands for the nodes' Python: the submit side asks it, not itself.
    venv = tmp_path / "nodes-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    profile = tmp_path / "p.yaml"
    profile.write_text((REPO / "cluster_profiles" / "testcluster.yaml").read_text()
                       + f"\npython: {venv / 'bin' / 'python'}\n")
    home = tmp_path / "home"
    out = hpcjobs("submit", "--profile", str(profile), "--nodes", "1", "--gpus", "1", "--run-dir",
                  str(tmp_path / "run"), "trainers.tasks.lm", "--tracker", "jsonl,tensorboard", cwd=REPO,
                  env={"HPCJOBS_HOME": str(home)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and (f"--tracker tensorboard: the tensorboard package is not installed in "
                                            f"{venv / 'bin' / 'python'}") in out.stderr
    assert "HINT: pip install tensorboard" in out.stderr
    assert not sbatch_log.exists() and not (tmp_path / "run").exists() and not home.exists()


def test_a_users_own_task_and_the_help_pass_to_the_ranks() -> None:
    from hpcjobs.request.taskcheck import check_task_flags

    check_task_flags("mypkg.mytask", ("--whatever", "3"), sys.executable)  # declared in the user's module
    check_task_flags("trainers.tasks.lm", ("--size", "huge", "--help"), sys.executable)  # the entry's help
    with pytest.raises(Exception, match="--size: invalid choice"):
        check_task_flags("trainers.tasks.lm", ("--size", "huge"), sys.executable)


def test_the_tasks_parse_with_the_declared_parsers() -> None:
    """One declaration: the task modules' own parsing is the shared parser's (a flag added there reaches both)."""
    from trainers.tasks import classifier, lm, lora

    for module in (lm, lora, classifier):
        name = module.__name__
        with pytest.raises(TaskArgError, match=f"^{name}: --not-a-flag is not a flag"):
            module.make_task(["--not-a-flag"])
        assert name in BUNDLED
    assert BUNDLED["trainers.tasks.lm"].parse([]).size == "tiny"


def test_a_number_flag_says_its_range() -> None:
    assert Number(int, low=1).describe() == "N with N ≥ 1"
    assert Number(float, low=0, high=1, below=True).describe() == "X with 0 ≤ X < 1"
    assert Number(float).describe() == "X"
    assert not Number(float).holds(float("nan"))
