"""Environment faults (issue 10): one line, exit 2 for a bad path given, 1 for a runtime fault, never a traceback,
nothing submitted, and nothing half-written left behind.

Read-only places are real read-only bind mounts made in a private mount namespace around the one command (we run as
root here and in CI, and root writes through file modes). A recording sbatch shim proves nothing was submitted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, sbatch_shim

GOOD = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
CAN_MOUNT = os.geteuid() == 0 and shutil.which("unshare") is not None


@pytest.fixture
def shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "sbatch-calls.log"
    sbatch_shim(tmp_path, monkeypatch, f'echo "$@" >> {log}\necho "Submitted batch job 77"\n')
    return log


def hpcjobs_in(tmp_path: Path, *args: str, read_only: Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [str(BIN / "hpcjobs"), *args]
    if read_only is not None:
        assert CAN_MOUNT
        mount = f'mount --bind -o ro "{read_only}" "{read_only}" && exec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *argv]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, **(env or {})})


def profile(tmp_path: Path, **change: object) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "runs_dir": str(tmp_path / "runs"), **change}))
    return str(path)


def assert_one_line(out: subprocess.CompletedProcess[str], code: int, fragment: str) -> None:
    assert out.returncode == code, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in out.stderr, out.stderr
    assert fragment in out.stderr and "HINT:" in out.stderr, out.stderr


def leftovers(root: Path) -> list[Path]:
    """Half-written files: temporaries of an atomic write that did not complete."""
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


SUBMIT = ("submit", "--nodes", "2", "--gpus", "8")
TASK = ("trainers.tasks.lm", "--steps", "5")


def test_run_dir_that_is_a_file(tmp_path: Path, shim: Path) -> None:
    (tmp_path / "taken").write_text("precious")
    out = hpcjobs_in(tmp_path, *SUBMIT, "--profile", profile(tmp_path), "--run-dir", str(tmp_path / "taken"), *TASK)
    assert_one_line(out, 2, "is a file, not a folder")
    assert (tmp_path / "taken").read_text() == "precious" and not shim.exists()


@pytest.mark.parametrize("run_dir", ["under/x", "under/x-%j"])
def test_run_dir_under_a_file(tmp_path: Path, shim: Path, run_dir: str) -> None:
    (tmp_path / "under").write_text("a file")
    out = hpcjobs_in(tmp_path, *SUBMIT, "--profile", profile(tmp_path), "--run-dir", str(tmp_path / run_dir), *TASK)
    assert_one_line(out, 2, "is a file, not a folder")
    assert not shim.exists()


def test_runs_dir_of_the_profile_under_a_file(tmp_path: Path, shim: Path) -> None:
    (tmp_path / "f").write_text("")
    out = hpcjobs_in(tmp_path, *SUBMIT, "--profile", profile(tmp_path, runs_dir=str(tmp_path / "f" / "runs")), *TASK)
    assert_one_line(out, 2, "is a file, not a folder")
    assert not shim.exists()


@pytest.mark.skipif(not CAN_MOUNT, reason="read-only bind mounts need root and unshare")
def test_read_only_run_dir(tmp_path: Path, shim: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    out = hpcjobs_in(tmp_path, *SUBMIT, "--profile", profile(tmp_path), "--run-dir", str(ro / "run"), *TASK,
                     read_only=ro)
    assert_one_line(out, 2, "is not writable")
    assert not shim.exists() and not list(ro.iterdir())


@pytest.mark.skipif(not CAN_MOUNT, reason="read-only bind mounts need root and unshare")
def test_read_only_local_run_dir_runs_nothing(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    out = hpcjobs_in(tmp_path, "submit", "--profile", "local", "--gpus", "1", "--run-dir", str(ro / "run"),
                     "trainers.tasks.classifier", read_only=ro)
    assert_one_line(out, 2, "is not writable")
    assert not list(ro.iterdir())


@pytest.mark.skipif(not CAN_MOUNT, reason="read-only bind mounts need root and unshare")
def test_read_only_job_store_submits_nothing(tmp_path: Path, shim: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    out = hpcjobs_in(tmp_path, *SUBMIT, "--profile", profile(tmp_path), *TASK, read_only=home,
                     env={"HPCJOBS_HOME": str(home)})
    assert_one_line(out, 1, "the job store")
    assert not shim.exists() and not (tmp_path / "runs").exists()


def test_corrupt_job_store_submits_nothing_and_says_how_to_recover(tmp_path: Path, shim: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "jobs.sqlite").write_bytes(b"\x00garbage" * 100)
    env = {"HPCJOBS_HOME": str(home)}
    out = hpcjobs_in(tmp_path, *SUBMIT, "--profile", profile(tmp_path), *TASK, env=env)
    assert_one_line(out, 1, "file is not a database")
    assert "mv " in out.stderr and not shim.exists()
    # Slurm knows no job 77 here (a job it knows by its comment is found anyway: test_faults_cluster.py).
    for tool in ("squeue", "sacct"):
        (tmp_path / "shim" / tool).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\n"
                                              "exit 1\n")
        (tmp_path / "shim" / tool).chmod(0o755)
    for command in (["list"], ["status", "77"], ["logs", "77"], ["cancel", "77"]):
        assert_one_line(hpcjobs_in(tmp_path, *command, env=env), 1, "the job store")
    assert (home / "jobs.sqlite").read_bytes() == b"\x00garbage" * 100  # left for the user to look at


def test_a_job_slurm_cannot_be_asked_about_is_not_called_unknown(tmp_path: Path, shim: Path) -> None:
    """The controller down: `status ID` of a job the store does not hold said Slurm knows no such job (exit 2, as
    for a typo); it says squeue could not answer (exit 1) and how to check. Recorded message: Slurm 22.05."""
    said = {"squeue": "slurm_load_jobs error: Unable to contact slurm controller (connect failure)",
            "sacct": "Slurm accounting storage is disabled"}  # a real sacct here may know a job 77 of the test cluster
    for tool, line in said.items():
        (tmp_path / "shim" / tool).write_text(f"#!/bin/sh\necho '{line}' >&2\nexit 1\n")
        (tmp_path / "shim" / tool).chmod(0o755)
    env = {"HPCJOBS_HOME": str(tmp_path / "home")}
    for command in (["status", "77"], ["logs", "77"], ["cancel", "77"]):
        out = hpcjobs_in(tmp_path, *command, env=env)
        assert_one_line(out, 1, "squeue could not answer for job 77: slurm_load_jobs error: Unable to contact")
        assert "scontrol ping" in out.stderr and "knows no hpcjobs job" not in out.stderr


@pytest.mark.skipif(not CAN_MOUNT, reason="read-only bind mounts need root and unshare")
def test_render_into_a_read_only_folder(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    out = hpcjobs_in(tmp_path, "render", "--profile", profile(tmp_path), "-o", str(ro / "job.sbatch"), *TASK,
                     read_only=ro)
    assert_one_line(out, 1, "nothing was written")
    assert not list(ro.iterdir())


def test_render_force_onto_a_folder(tmp_path: Path) -> None:
    target = tmp_path / "adir"
    target.mkdir()
    out = hpcjobs_in(tmp_path, "render", "--force", "--profile", profile(tmp_path), "-o", str(target), *TASK)
    assert_one_line(out, 2, "is a folder")
    assert not leftovers(tmp_path) and not list(target.iterdir())


def test_render_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("keep")
    out = hpcjobs_in(tmp_path, "render", "--profile", profile(tmp_path), "-o", str(tmp_path / "f" / "job.sbatch"),
                     *TASK)
    assert_one_line(out, 2, "f is a file, not a folder; nothing was written")  # a bad path given, found before
    assert (tmp_path / "f").read_text() == "keep" and not leftovers(tmp_path)  # the snapshot is copied
    assert not (tmp_path / "runs").exists()


def test_logs_of_a_job_whose_run_folder_is_gone(tmp_path: Path, shim: Path) -> None:
    env = {"HPCJOBS_HOME": str(tmp_path / "home")}
    out = hpcjobs_in(tmp_path, *SUBMIT, "--profile", profile(tmp_path), "--run-dir", str(tmp_path / "r"), *TASK,
                     env=env)
    assert out.returncode == 0, out.stderr
    shutil.rmtree(tmp_path / "r")
    assert_one_line(hpcjobs_in(tmp_path, "logs", "77", env=env), 2, "has no logs")


def test_a_damaged_store_row_and_hand_edited_run_records_still_answer(tmp_path: Path) -> None:
    """A store row whose JSON columns were damaged, and restarts/failures lines that are not the launcher's records
    (a number, a list, a restart count as text): list, status and compare answer from what is left (each was a
    traceback: JSONDecodeError, TypeError), and a question to an empty HPCJOBS_HOME creates no store."""
    import json
    import sqlite3
    import time

    from hpcjobs.jobs.store import JobRecord, JobStore
    from hpcjobs.protocol.errors import RuntimeFailure

    run, home = tmp_path / "run", tmp_path / "home"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps({"name": "lm"}))
    start = {"restart": 1, "time": time.time(), "job_id": "local-1", "world_size": 2}
    (run / "restarts.jsonl").write_text('5\n{"restart": "x"}\n[1, 2]\n' + json.dumps(start) + "\n")
    (run / "failures.jsonl").write_text('{"rank": "3", "restart": 1, "job_id": "local-1"}\n"text"\n')
    env = {"HPCJOBS_HOME": str(home)}
    assert_one_line(hpcjobs_in(tmp_path, "status", "abc", env=env), 2, "abc")
    assert not home.exists()
    (tmp_path / "afile").write_text("")
    with pytest.raises(RuntimeFailure, match="afile is a file, not a folder"):  # not mkdir's "File exists"
        JobStore(tmp_path / "afile" / "jobs.sqlite").check()
    store = JobStore(home / "jobs.sqlite")
    store.add(JobRecord("local-1", "lm", "local", "local", 1, 2, str(run), {"out": "x"}, {"name": "lm"}, time.time()))
    with sqlite3.connect(store.path) as con:
        con.execute("UPDATE jobs SET logs='{not json', spec='5'")
    for command in (["list"], ["status", "local-1"], ["compare", str(run)]):
        out = hpcjobs_in(tmp_path, *command, env=env)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (command, out.stderr)
    assert "restarts:    1" in hpcjobs_in(tmp_path, "status", "local-1", env=env).stdout
