"""The submit side's remaining bad inputs (issue 38 item 4): each is one line naming what was given, what is valid and
a HINT, exit code 2, before anything is queued or written (no run folder, no code snapshot, no job record).

tests/test_bad_inputs.py holds the earlier ones; these each got through, or got the wrong answer, before."""

from __future__ import annotations

import json
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


def _job_records() -> int:
    return len(json.loads(hpcjobs("list", "--json").stdout))


@pytest.mark.train
def test_a_resume_the_checkpoint_would_refuse_is_refused_at_submit(tmp_path: Path, sbatch_log: Path) -> None:
    """A resume whose settings differ from its checkpoint's was refused only once the ranks had started: a job
    record more, a start more in the run folder (and the run then turned UNKNOWN). Now at submit, from the
    checkpoint's recorded settings, before anything is written; the same flags still resume."""
    run = tmp_path / "run"
    base = ["submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), "trainers.tasks.lm",
            "--size", "tiny", "--log-every", "5"]
    first = hpcjobs(*base, "--steps", "6", "--lr", "1e-3", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr
    specs, restarts = sorted((run / "specs").iterdir()), (run / "restarts.jsonl").read_text()
    for flags, fragment in ((["--steps", "12", "--lr", "1e-3"], "--steps 6, this submission asks for --steps 12"),
                            (["--steps", "6", "--lr", "3e-4"], "lr: 0.001 → 0.0003")):
        out = hpcjobs(*base, *flags, cwd=tmp_path)
        assert_refused(out, fragment, sbatch_log)
        assert f"checkpoint {run}/checkpoints/step-6" in out.stderr
    world = hpcjobs(*[w if w != "2" else "1" for w in base], "--steps", "6", "--lr", "1e-3", cwd=tmp_path)
    assert_refused(world, "was written by 2 ranks with --strategy ddp, this submission has 1", sbatch_log)
    assert sorted((run / "specs").iterdir()) == specs and (run / "restarts.jsonl").read_text() == restarts
    assert _job_records() == 1
    extended = hpcjobs(*base, "--steps", "8", "--lr", "1e-3", "--extend", cwd=tmp_path, timeout=300)
    assert extended.returncode == 0, extended.stderr


def test_a_time_limit_that_leaves_little_of_each_chunk_gets_one_warning(tmp_path: Path, sbatch_log: Path) -> None:
    """`--time 2:00` with a 60 s warning: after the warning and the start-up, a chunk trains for seconds. Said at
    submit (one line naming a --time and a seconds_before that would work), not refused."""
    out = hpcjobs("submit", "--profile", "testcluster", "--dry-run", "--time", "2:00", "trainers.tasks.lm",
                  "--steps", "5", cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "warning" in line]
    assert len(lines) == 1, out.stderr
    assert "--time 00:02:00 leaves about 15 s of each time-limit chunk" in lines[0], lines[0]
    assert "seconds_before 60" in lines[0] and "about 45 s, assumed" in lines[0], lines[0]
    assert ("HINT: ask for --time 00:09:00 or more (it leaves ~80% of each chunk to training), or lower "
            "preemption.seconds_before to 15") in lines[0], lines[0]
    roomy = hpcjobs("submit", "--profile", "testcluster", "--dry-run", "--time", "30:00", "trainers.tasks.lm",
                    "--steps", "5", cwd=REPO)
    assert roomy.returncode == 0 and "warning" not in roomy.stderr, roomy.stderr
    assert not sbatch_log.exists()


def test_the_warning_counts_this_run_folder_s_measured_start_up(tmp_path: Path) -> None:
    """Where the run folder has started before, its measured start-up (startup.jsonl: launched → first step)
    is what the warning counts, not the assumed one; with no seconds_before that would do, only the --time."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "startup.jsonl").write_text(json.dumps({"launched": 100.0, "first_step": 400.0, "rank": 0}) + "\n")
    out = hpcjobs("submit", "--profile", "testcluster", "--dry-run", "--time", "10:00", "--run-dir", str(run),
                  "trainers.tasks.lm", "--steps", "5", cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "start-up (300 s measured in this run folder)" in out.stderr, out.stderr
    assert "HINT: ask for --time 00:30:00 or more (it leaves ~80% of each chunk to training)." in out.stderr, \
        out.stderr


def test_a_submission_sbatch_refuses_leaves_nothing_behind(tmp_path: Path, sbatch_log: Path) -> None:
    """sbatch's refusal (an account or qos the cluster does not take) left the code snapshot and the runs folder
    it was made in; now the submission that made them takes them away (and its run folder, as before)."""
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({**GOOD, "runs_dir": str(tmp_path / "runs")}))
    out = hpcjobs("submit", "--profile", str(prof), "--account", "nosuch", "trainers.tasks.lm", cwd=REPO)
    assert out.returncode == 1 and "sbatch refused the job" in out.stderr, out.stderr
    assert sbatch_log.exists()
    nothing_left(tmp_path)
    (tmp_path / "runs" / ".snapshots").mkdir(parents=True)  # a runs folder that was there stays, as it was
    out = hpcjobs("submit", "--profile", str(prof), "--account", "nosuch", "trainers.tasks.lm", cwd=REPO)
    assert out.returncode == 1, out.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [".snapshots"]
    assert list((tmp_path / "runs" / ".snapshots").iterdir()) == []
