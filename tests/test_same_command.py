"""Issue 37, item 1: the same `hpcjobs submit` command (entry, its arguments, profile, nodes, GPUs, --env, --container,
from the same folder) continues the newest run of that command instead of starting a fresh run folder: after a
Ctrl-C, a failure or a kill it resumes there and says so in one line; a finished one is refused in one line, exit 2,
nothing written; another command, or `--new`, starts fresh; a job of it still running is refused. Local profile, real
processes: plain scripts (fast), the shared trainer and a StopGuard script (`train`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest
import torch
import yaml

from conftest import BIN, REPO, hpcjobs, sbatch_shim
from hpcjobs.backends.slurm.sbatch import COMMENT_TAG
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

FLAKY = """import os, sys
from pathlib import Path
seen = Path(os.environ["HPCJOBS_RUN_DIR"]) / "starts.txt"
starts = int(seen.read_text()) if seen.exists() else 0
seen.write_text(str(starts + 1))
print(f"start {starts + 1} args {sys.argv[1:]}", flush=True)
sys.exit(1 if starts == 0 and "--fail-once" in sys.argv else 0)
"""
"""A script that fails its first start (with --fail-once) and counts its starts in its run folder."""

FOREVER = """import os, sys, time
from pathlib import Path
(Path(sys.argv[1]) / f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def submit(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return hpcjobs("submit", "--profile", "local", "--gpus", "1", "--max-recoveries", "0", *args, cwd=tmp_path,
                   env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)


def run_folders(tmp_path: Path) -> list[Path]:
    root = tmp_path / "runs"
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []


def jobs() -> list[dict[str, object]]:
    return list(json.loads(hpcjobs("list", "--json").stdout))


def hpcjobs_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("hpcjobs")]


@pytest.fixture
def flaky(tmp_path: Path) -> Path:
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    return script


def test_a_failed_script_is_continued_by_the_same_command_in_its_run_folder(tmp_path: Path, flaky: Path) -> None:
    first = submit(tmp_path, str(flaky), "--fail-once")
    assert first.returncode != 0 and "start 1" in first.stdout + first.stderr, first.stderr
    [run] = run_folders(tmp_path)
    # --time and --name do not change what trains: still the same command.
    again = submit(tmp_path, "--time", "0:10:00", "--name", "again", str(flaky), "--fail-once")
    assert again.returncode == 0, again.stdout + again.stderr
    assert run_folders(tmp_path) == [run]  # no second run folder
    assert (run / "starts.txt").read_text() == "2"
    said = [line for line in again.stderr.splitlines() if "continuing" in line]
    assert len(said) == 1 and str(run) in said[0] and "--new" in said[0], again.stderr
    assert "no checkpoint" in said[0]  # a plain script: hpcjobs knows of none
    assert len(jobs()) == 2


def test_a_finished_runs_same_command_is_refused_and_writes_nothing(tmp_path: Path, flaky: Path) -> None:
    done = submit(tmp_path, str(flaky))
    assert done.returncode == 0, done.stderr
    [run] = run_folders(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "hpcjobs-home" not in p.parts)
    again = submit(tmp_path, str(flaky))
    assert again.returncode == 2, again.stdout + again.stderr
    [line] = again.stderr.strip().splitlines()
    assert "already finished" in line and str(run) in line and "--new" in line and "--run-dir" in line, line
    assert again.stdout == ""
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "hpcjobs-home" not in p.parts) == before
    assert len(jobs()) == 1 and (run / "starts.txt").read_text() == "1"
    # The same refusal on --dry-run: it shows what submit would do.
    assert submit(tmp_path, "--dry-run", str(flaky)).returncode == 2


def test_a_sweep_run_again_starts_fresh_as_before(tmp_path: Path, flaky: Path) -> None:
    for _ in range(2):
        out = submit(tmp_path, "--sweep", "seed=1,2", str(flaky))
        assert out.returncode == 0 and "continuing" not in out.stderr, out.stdout + out.stderr
    assert len(jobs()) == 4  # two arrays of two tasks each


@pytest.mark.train
def test_new_and_another_command_start_fresh_and_the_newest_run_is_the_one_continued(tmp_path: Path,
                                                                                      flaky: Path) -> None:
    assert submit(tmp_path, str(flaky), "--fail-once").returncode != 0
    [first] = run_folders(tmp_path)
    time.sleep(1.1)  # run folders are named by the second
    fresh = submit(tmp_path, "--new", str(flaky), "--fail-once")
    assert fresh.returncode != 0 and "continuing" not in fresh.stderr, fresh.stderr
    [second] = [p for p in run_folders(tmp_path) if p != first]
    time.sleep(1.1)
    other = submit(tmp_path, str(flaky), "--fail-once", "--other")  # another argument: another command
    assert other.returncode != 0 and "continuing" not in other.stderr, other.stderr
    assert len(run_folders(tmp_path)) == 3
    again = submit(tmp_path, str(flaky), "--fail-once")  # continues the --new run, the newest of this command
    assert again.returncode == 0 and f"continuing {second}" in again.stderr, again.stderr
    assert (second / "starts.txt").read_text() == "2" and (first / "starts.txt").read_text() == "1"
    # --gpus is the shape: another one is another command.
    two = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--max-recoveries", "0", str(flaky), "--fail-once",
                  cwd=tmp_path)
    assert "continuing" not in two.stderr and len(run_folders(tmp_path)) == 4, two.stderr


def test_a_deleted_run_folder_is_not_continued(tmp_path: Path, flaky: Path) -> None:
    assert submit(tmp_path, str(flaky), "--fail-once").returncode != 0
    [run] = run_folders(tmp_path)
    for p in sorted(run.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    run.rmdir()
    again = submit(tmp_path, str(flaky), "--fail-once")
    assert again.returncode != 0 and "continuing" not in again.stderr, again.stderr
    assert len(run_folders(tmp_path)) == 1


def test_new_with_run_dir_is_refused(tmp_path: Path, flaky: Path) -> None:
    out = submit(tmp_path, "--new", "--run-dir", str(tmp_path / "r"), str(flaky))
    assert out.returncode == 2 and "--new with --run-dir" in out.stderr and "HINT:" in out.stderr, out.stderr
    assert not (tmp_path / "r").exists() and jobs() == []


def test_an_explicit_run_dir_is_as_before(tmp_path: Path, flaky: Path) -> None:
    """--run-dir names the folder: a finished one is used as given (the entry decides what to do there)."""
    run = tmp_path / "mine"
    assert submit(tmp_path, "--run-dir", str(run), str(flaky)).returncode == 0
    again = submit(tmp_path, "--run-dir", str(run), str(flaky))
    assert again.returncode == 0 and "continuing" not in again.stderr, again.stderr
    assert (run / "starts.txt").read_text() == "2"


def test_a_running_same_command_is_refused(tmp_path: Path) -> None:
    script, pids = tmp_path / "forever.py", tmp_path / "pids"
    script.write_text(FOREVER)
    pids.mkdir()
    argv = [str(BIN / "hpcjobs"), "submit", "--profile", "local", "--gpus", "1", str(script), str(pids)]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 60
        while not list(pids.glob("rank-*.pid")):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.1)
        job = jobs()[0]["job_id"]
        again = submit(tmp_path, str(script), str(pids), timeout=30)
        assert again.returncode == 2, again.stdout + again.stderr
        [line] = again.stderr.strip().splitlines()
        assert f"job {job}" in line and f"hpcjobs cancel {job}" in line and "--new" in line, line
        assert len(run_folders(tmp_path)) == 1 and len(jobs()) == 1
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)


# --- training: the shared trainer and a StopGuard script, stopped by Ctrl-C -------------------------------------

STEPS = 300
TASK = ["--gpus", "2", "trainers.tasks.classifier", "--steps", str(STEPS), "--log-every", "10", "--ckpt-every", "0",
        "--seed", "3"]
SLOW = {"HPCJOBS_FAULT_SLOW_STEP": "0.03"}
"""Slower steps (an environment variable of the shell, not part of the command) so a Ctrl-C lands mid-run."""


def ctrl_c(tmp_path: Path, argv: list[str], ready: str, env: dict[str, str]) -> str:
    """`hpcjobs submit ARGV` in a session of its own, one Ctrl-C (to its process group, as a terminal does) once
    rank 0's log of the run folder it made holds `ready`; everything it printed."""
    proc = subprocess.Popen([str(BIN / "hpcjobs"), "submit", "--profile", "local", *argv], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    deadline = time.time() + 180
    while not any(ready in log.read_text() for log in (tmp_path / "runs").glob("*/logs/restart-0/rank-0.log")):
        assert time.time() < deadline and proc.poll() is None, "never started"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out
    return out


def stop_step(run: Path) -> int:
    stops = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines() if '"stopped"' in x]
    return int(stops[-1]["step"])


@pytest.mark.train
def test_ctrl_c_then_the_same_command_resumes_the_shared_trainer_exactly(tmp_path: Path) -> None:
    twin_dir = tmp_path / "twin"  # another folder: another command, an uninterrupted run of it
    twin_dir.mkdir()
    twin = hpcjobs("submit", "--profile", "local", *TASK, cwd=twin_dir, timeout=300)
    assert twin.returncode == 0, twin.stderr[-3000:]
    [twin_run] = run_folders(twin_dir)
    said = ctrl_c(tmp_path, TASK, "step 30 ", SLOW)
    [run] = run_folders(tmp_path)
    assert f"to resume, run the same command again (it continues {run};" in said, said[-3000:]
    stop = stop_step(run)
    assert 0 < stop < STEPS and checkpoint.latest(run / "checkpoints").step == stop

    again = hpcjobs("submit", "--profile", "local", *TASK, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    [line] = [x for x in again.stderr.splitlines() if "continuing" in x]
    assert f"continuing {run}" in line and f"from step {stop}" in line, line
    assert run_folders(tmp_path) == [run]
    log = (run / "logs" / "restart-1" / "rank-0.log").read_text()
    assert f"(step {stop}," in log  # "resumed from ... (step N, ...)"
    mine, theirs = model_weights(checkpoint.latest(run / "checkpoints")), \
        model_weights(checkpoint.latest(twin_run / "checkpoints"))
    assert checkpoint.latest(run / "checkpoints").step == STEPS
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    finished = hpcjobs("submit", "--profile", "local", *TASK, cwd=tmp_path)
    assert finished.returncode == 2, finished.stderr
    [said] = finished.stderr.strip().splitlines()
    assert f"at step {STEPS}" in said and str(run) in said and "--extend" in said, said
    # What the line promises: more steps in that run folder, with --extend, train on from the finished step.
    more = [a if a != str(STEPS) else str(STEPS + 30) for a in TASK]
    extended = hpcjobs("submit", "--profile", "local", "--run-dir", str(run), *more, "--extend", cwd=tmp_path,
                       timeout=300)
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert checkpoint.latest(run / "checkpoints").step == STEPS + 30
    assert f"(step {STEPS}," in (run / "logs" / "restart-2" / "rank-0.log").read_text()
    fewer = [a if a != str(STEPS) else "20" for a in TASK]  # another --steps: another command, a fresh run
    fresh = hpcjobs("submit", "--profile", "local", *fewer, cwd=tmp_path, timeout=300)
    assert fresh.returncode == 0 and "continuing" not in fresh.stderr, fresh.stderr[-3000:]
    assert len(run_folders(tmp_path)) == 2


OWN = ["--gpus", "2", str(REPO / "trainers" / "examples" / "own_script.py"), "--steps", "3000"]


@pytest.mark.train
def test_ctrl_c_then_the_same_command_resumes_a_stopguard_script(tmp_path: Path) -> None:
    ctrl_c(tmp_path, OWN, "step 100 ", {})
    [run] = run_folders(tmp_path)
    stop = stop_step(run)
    assert 0 < stop < 3000 and checkpoint.latest(run / "checkpoints").step == stop
    again = hpcjobs("submit", "--profile", "local", *OWN, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    [line] = [x for x in again.stderr.splitlines() if "continuing" in x]
    assert f"continuing {run}" in line and f"from step {stop}" in line, line
    assert f"resumed from {run / 'checkpoints' / f'step-{stop}'}" in again.stdout
    assert "done at step 3000" in again.stdout and run_folders(tmp_path) == [run]


def test_on_slurm_a_queued_or_untold_job_is_not_joined_and_a_forgotten_one_is_continued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """squeue says PENDING (a requeued job waits too): refused; squeue cannot reach the controller: refused, it may be
    queued; squeue has forgotten the job and the folder holds no end: continued. --new still submits."""
    shim = sbatch_shim(tmp_path, monkeypatch, 'echo "Submitted batch job 4711"\n')
    answer = tmp_path / "squeue.sh"
    (shim / "squeue").write_text(f"#!/bin/sh\n. {answer}\n")
    (shim / "squeue").chmod(0o755)
    prof = tmp_path / "p.yaml"
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    prof.write_text(yaml.safe_dump({**data, "runs_dir": f"{tmp_path}/r"}))
    argv = ["submit", "--profile", str(prof), "trainers.tasks.lm", "--steps", "5"]
    answer.write_text("echo 'Invalid job id specified' >&2; exit 1\n")
    assert hpcjobs(*argv, cwd=tmp_path).returncode == 0
    run, made = Path(str(jobs()[0]["run_dir"])), sorted((tmp_path / "r").iterdir())
    for said, why in ((f"echo 'PENDING|{COMMENT_TAG}{urllib.parse.quote(str(run))}'\n", "still pending as job 4711"),
                      ("echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1\n",
                       "cannot tell")):
        answer.write_text(said)
        again = hpcjobs(*argv, cwd=tmp_path)
        assert again.returncode == 2, again.stdout + again.stderr
        [line] = again.stderr.strip().splitlines()
        assert why in line and "4711" in line and "--new" in line, line
        assert len(jobs()) == 1 and sorted((tmp_path / "r").iterdir()) == made
    answer.write_text("echo 'Invalid job id specified' >&2; exit 1\n")
    again = hpcjobs(*argv, cwd=tmp_path)
    assert again.returncode == 0 and f"continuing {run} (job 4711)" in again.stderr, again.stderr
    assert len(jobs()) == 2 and sorted((tmp_path / "r").iterdir()) == made


LIGHTNING = REPO / "tests" / "scripts" / "lightning_script.py"


@pytest.mark.train
def test_ctrl_c_then_the_same_command_resumes_an_unchanged_lightning_script(tmp_path: Path) -> None:
    """The integrations' checkpoints are told of by the run folder's script-checkpoint.json: the line names its step,
    and the script resumes there (exactness itself: tests/test_lightning.py, on the same mechanism)."""
    import ctrl_c_runs
    from test_lightning import STEPS, losses

    argv = ["submit", "--profile", "local", "--gpus", "2", *ctrl_c_runs.CHECKS, str(LIGHTNING), "--out",
            str(tmp_path / "out"), "--sample_seconds", "0.01"]
    first = ctrl_c_runs.interrupt(argv, tmp_path, losses, after=12)
    [run] = run_folders(tmp_path)
    stop = max(losses(first))
    assert 12 <= stop < STEPS, first[-3000:]
    again = hpcjobs(*argv, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    [line] = [x for x in again.stderr.splitlines() if "continuing" in x]
    assert f"continuing {run}" in line and f"from step {stop}" in line, line
    assert sorted(losses(again.stdout)) == list(range(stop + 1, STEPS + 1)) and run_folders(tmp_path) == [run]
