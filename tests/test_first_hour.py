"""A new user's first hour (issue 10): the README's instructions work as typed, mistakes are refused cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, REPO, hpcjobs

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


# --- local jobs: a real run on this machine, followed and stopped like a user would --------------------------------

LONG_RUN = ["trainers.tasks.lm", "--size", "tiny", "--steps", "100000", "--log-every", "5", "--ckpt-every", "0"]


def start_local(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    """`hpcjobs submit --profile local` in a session of its own (as a terminal would run it), once it trains."""
    proc = subprocess.Popen([str(BIN / "hpcjobs"), "submit", "--profile", "local", "--gpus", "2", "--run-dir",
                             str(run_dir), *extra, *LONG_RUN], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not (run_dir / "heartbeat.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    return proc


def job_id_of(run_dir: Path) -> str:
    return json.loads((run_dir / "local-process.json").read_text())["job_id"]


def wait_stopped(run_dir: Path, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        history = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
        if "stopped" in history[-1]:
            return history[-1]
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} never recorded a stop")


@pytest.mark.train
def test_ctrl_c_twice_still_commits_a_checkpoint_and_exits_130(tmp_path: Path) -> None:
    """The terminal's Ctrl-C goes to the whole foreground group; only hpcjobs may act on it (a second one used to
    end the job with exit 254). It exits as an interrupted command does (it exited 0: `submit && next` went on)."""
    run = tmp_path / "run"
    proc = start_local(run)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "still stopping" in err
    stop = wait_stopped(run)
    assert (run / "checkpoints" / f"step-{stop['step']}" / "FINISHED").is_file()
    st = json.loads(subprocess.run([str(BIN / "hpcjobs"), "status", job_id_of(run), "--json"], capture_output=True,
                                   text=True).stdout)
    assert st["state"] == "STOPPED" and st["last_step"] == stop["step"]


@pytest.mark.train
def test_cancel_stops_a_local_job_at_a_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_local(run)
    out = hpcjobs("cancel", job_id_of(run))
    assert out.returncode == 0 and "asked to stop" in out.stdout, out.stderr
    proc.communicate(timeout=120)
    stop = wait_stopped(run)
    assert (run / "checkpoints" / f"step-{stop['step']}" / "FINISHED").is_file()


@pytest.mark.train
def test_a_killed_launcher_takes_its_ranks_down_at_a_checkpoint(tmp_path: Path) -> None:
    """SIGKILL of `hpcjobs submit` used to leave the ranks training as orphans and status RUNNING forever."""
    run = tmp_path / "run"
    proc = start_local(run)
    proc.kill()
    proc.communicate()
    stop = wait_stopped(run)
    assert (run / "checkpoints" / f"step-{stop['step']}" / "FINISHED").is_file()
    st = json.loads(hpcjobs("status", job_id_of(run), "--json").stdout)
    assert st["state"] in ("STOPPED", "FAILED") and st["state"] != "RUNNING"


@pytest.mark.train
def test_json_output_of_a_local_run_is_json_alone(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(tmp_path / "r"), "--json",
                  "trainers.tasks.classifier", "--steps", "3", "--log-every", "1", cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["returncode"] == 0  # training's own lines went to stderr
    assert "step 3" in out.stderr


@pytest.mark.train
def test_every_submission_to_a_folder_keeps_its_spec(tmp_path: Path) -> None:
    run = tmp_path / "r"
    for args in (["--steps", "2"], ["--steps", "3", "--extend"]):
        out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run),
                      "trainers.tasks.classifier", *args, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr
    first, second = (json.loads((run / "specs" / f"{n}.json").read_text()) for n in (1, 2))
    assert first["entry"]["args"] == ["--steps", "2"] and second["entry"]["args"] == ["--steps", "3", "--extend"]
    assert json.loads((run / "spec.json").read_text()) == second


@pytest.mark.train
def test_entry_help_lists_the_flags_and_touches_nothing(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "trainers.tasks.lm", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--steps" in out.stdout and "--size" in out.stdout  # the trainer's flags and the task's
    assert not list(tmp_path.iterdir()) and json.loads(hpcjobs("list", "--json").stdout) == []


@pytest.mark.train
def test_a_bad_task_argument_is_one_line_not_a_traceback_per_rank(tmp_path: Path) -> None:
    """`--size huge` printed the same traceback once per rank (100+ lines). The submit side now refuses it before
    anything starts; what only the nodes can know (7b needs CUDA) is one line from rank 0."""
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(tmp_path / "r"),
                  "trainers.tasks.lm", "--size", "huge", cwd=REPO, timeout=300)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out
    assert "invalid choice: 'huge'" in out.stderr and not (tmp_path / "r").exists()
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(tmp_path / "r"),
                  "trainers.tasks.lm", "--size", "7b", cwd=REPO, timeout=300)
    said = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in said, said
    errors = [line for line in said.splitlines() if "--size 7b needs GPUs" in line]
    assert errors and all("rank 0" in line for line in errors) and len(said.splitlines()) <= 6, said
    assert "Traceback" in (tmp_path / "r" / "logs" / "restart-0" / "rank-0.log").read_text()  # kept for debugging


IGNORES_HELP = """import argparse, pathlib
p = argparse.ArgumentParser(add_help=False)  # its own way: --help is not answered, training starts
p.add_argument("data")
p.add_argument("--epochs", type=int, default=3, help="how many passes")
p.add_argument("--out", required=True)
args, _ = p.parse_known_args()
pathlib.Path("TRAINED").write_text("on the submit host")
"""


@pytest.mark.parametrize("entry", ["train.py", "-m mypkg.train"])
def test_a_scripts_help_is_read_from_its_source_and_the_script_never_runs_here(tmp_path: Path, entry: str) -> None:
    """Issue 37: `submit ... train.py --help` ran the script on the submit host; one that ignores --help trained."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "train.py").write_text(IGNORES_HELP)
    (tmp_path / "mypkg" / "train.py").write_text(IGNORES_HELP)
    out = hpcjobs("submit", "--profile", "local", *entry.split(), "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "TRAINED").exists() and not (tmp_path / "runs").exists()
    assert "read from its source (hpcjobs does not run your script on this host" in out.stdout
    assert "--epochs INT default 3 — how many passes" in out.stdout and "--out (required)" in out.stdout
    assert out.stdout.splitlines()[1].strip() == "data"  # positionals first
