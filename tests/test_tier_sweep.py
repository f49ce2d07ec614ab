"""Stale node-local tier folders (issue 40; hpcjobs.protocol.tiersweep): a job killed as a whole (scancel past
KillWait, a local job whose hpcjobs process was SIGKILLed) leaves /dev/shm/hpcjobs-JOB/ until a reboot. A new job's
first rank on a node (trainers.tiersweep) and the local backend's start (hpcjobs.backends.local.tiers) remove this
user's folders whose jobs ended; another user's, the starting job's own, and one whose state is not known stay.
Real folders in a tmp base; the jobs' states from a fake `alive`, a recorded `scontrol`, or real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.protocol.tierfiles import job_folder, job_folder_name
from hpcjobs.protocol.tiersweep import PREFIX, judge, local_alive, sweep
from trainers import tiersweep
from trainers.distenv import from_environ
from trainers.jobenv.slurm import job_alive


def folder(base: Path, job_id: str, size: int = 1000) -> Path:
    path = base / job_folder_name(job_id) / "abc123"
    path.mkdir(parents=True)
    (path / "rank-0-of-2.step-5.pt").write_bytes(b"x" * size)
    return path.parent


def test_only_this_users_folders_of_ended_jobs_go(tmp_path: Path) -> None:
    base = tmp_path / "shm"
    ended, running, unknown, mine = (folder(base, j) for j in ("100", "101", "102", "200"))
    theirs = folder(base, "103")
    os.chown(theirs, os.getuid() + 1, -1)  # another user's: never asked about, never removed
    (tmp_path / "elsewhere").mkdir()
    (base / f"{PREFIX}104").symlink_to(tmp_path / "elsewhere")  # a link: never followed
    (base / f"{PREFIX}105").write_text("a file")
    (base / "other").mkdir()
    states = {"100": False, "101": True, "102": None}
    asked: list[str] = []
    said: list[str] = []

    def alive(job_id: str) -> bool | None:
        asked.append(job_id)
        return states[job_id]

    swept = sweep(base, {"200"}, alive, say=said.append)
    assert sorted(asked) == ["100", "101", "102"]
    assert not ended.exists() and running.exists() and unknown.exists() and mine.exists() and theirs.exists()
    assert (tmp_path / "elsewhere").is_dir() and (base / f"{PREFIX}105").is_file() and (base / "other").is_dir()
    assert [f.path for f in swept.removed] == [ended] and swept.removed[0].size == 1000
    assert [f.path for f in swept.left] == [unknown] and {f.path for f in swept.kept} == {running, mine}
    assert len(said) == 2 and str(ended) in said[0] and "removed 1 folder" in said[0], said
    assert str(unknown) in said[1] and "cannot be learned" in said[1] and str(running) not in " ".join(said), said


def test_nothing_to_sweep_asks_nothing_and_says_nothing(tmp_path: Path) -> None:
    said: list[str] = []
    swept = sweep(tmp_path / "missing", set(), lambda j: pytest.fail(j), say=said.append)
    assert said == [] and not swept.removed and not swept.left and not swept.kept


class Scontrol:
    """`scontrol show job -o ID` as Slurm answers it: a state, or "Invalid job id specified" once forgotten."""

    def __init__(self, states: dict[str, str | None]) -> None:
        self.states, self.asked = states, []  # type: dict[str, str | None], list[list[str]]

    def __call__(self, cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        self.asked.append(cmd)
        state = self.states[cmd[-1]]
        if state is None:
            return subprocess.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
        if state == "no answer":
            raise OSError("scontrol: not found")
        return subprocess.CompletedProcess(cmd, 0, f"JobId={cmd[-1]} JobName=lm UserId=u(1) JobState={state} "
                                                    "Reason=None\n", "")


@pytest.mark.parametrize(("state", "alive"), [("RUNNING", True), ("PENDING", True), ("COMPLETING", True),
                                              ("PREEMPTED", True), ("SUSPENDED", True), ("COMPLETED", False),
                                              ("CANCELLED", False), ("FAILED", False), ("TIMEOUT", False),
                                              ("NODE_FAIL", False), (None, False), ("no answer", None)])
def test_slurm_says_whether_a_job_still_runs_or_waits(state: str | None, alive: bool | None) -> None:
    assert job_alive("57", Scontrol({"57": state})) is alive
    assert job_alive("57_1", Scontrol({"57_1": state})) is alive  # an array task, as its folder names it


def test_ids_that_are_no_slurm_jobs_are_not_asked() -> None:
    runner = Scontrol({})
    assert [job_alive(j, runner) for j in ("local-20260101000000-1", "nojob", "_1", "57_", "5 7")] == [None] * 5
    assert runner.asked == []


def rank_env(tmp_path: Path, local_rank: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "300", "SLURM_PROCID": str(local_rank), "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(local_rank), "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_NODELIST": "node1", "SLURM_JOB_NODELIST": "node1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "HPCJOBS_LOCAL_CKPT_DIR": str(tmp_path / "shm"), "PATH": os.environ["PATH"]}


def test_a_jobs_first_rank_on_a_node_sweeps_and_the_others_do_not(tmp_path: Path) -> None:
    """trainers.tiersweep.at_start (the line trainers/launch.py runs): Slurm's jobs through scontrol."""
    base = tmp_path / "shm"
    scancelled, requeued, own = folder(base, "298"), folder(base, "299"), folder(base, "300")
    runner = Scontrol({"298": "CANCELLED", "299": "PENDING"})
    environ = rank_env(tmp_path, 1)
    assert tiersweep.at_start(from_environ(environ), environ, runner) is None and runner.asked == []
    environ = rank_env(tmp_path, 0)
    swept = tiersweep.at_start(from_environ(environ), environ, runner)
    assert swept is not None and not scancelled.exists() and requeued.exists() and own.exists()
    assert sorted(c[-1] for c in runner.asked) == ["298", "299"]


def launcher(*words: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *words])


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def local_id(pid: int, task: str = "") -> str:
    return f"local-{time.strftime('%Y%m%d%H%M%S')}-{pid}{task}"


def test_a_local_job_lives_while_its_hpcjobs_process_does() -> None:
    live, other = launcher("hpcjobs"), launcher("unrelated")  # the pid taken by an unrelated process: gone
    try:
        assert local_alive(local_id(live.pid)) is True and local_alive(local_id(live.pid, "-2_3")) is True
        assert local_alive(local_id(other.pid)) is False and local_alive(local_id(dead_pid())) is False
        assert local_alive("4242") is None and local_alive("local-x-1") is None
    finally:
        for p in (live, other):
            p.kill()
            p.wait()


def tier_env(tmp_path: Path) -> dict[str, str]:
    return {"HPCJOBS_LOCAL_CKPT_DIR": str(tmp_path / "shm")}


def test_doctor_reports_stale_local_folders_and_their_size_and_removes_nothing(tmp_path: Path) -> None:
    stale = folder(tmp_path / "shm", local_id(dead_pid()), size=3 << 20)
    folder(tmp_path / "shm", "4242")  # a Slurm job's: not the local backend's to judge, not said
    out = hpcjobs("doctor", "--profile", "local", "--gpus", "1", "--json", cwd=REPO, env=tier_env(tmp_path))
    row = next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "node-local tier")
    assert out.returncode == 0 and str(stale) in row["found"] and "3.0 MiB" in row["found"], row
    assert "4242" not in row["found"] and stale.exists()
    assert judge(tmp_path / "shm", (), lambda j: False).removed  # a sweep would remove them


SCRIPT = "print('hello from the rank')\n"


def test_a_local_jobs_start_removes_what_a_killed_local_job_left(tmp_path: Path) -> None:
    """The defect: a local job whose hpcjobs process was SIGKILLed left its tier folder for good; the next local
    job's start removes it (and keeps a live job's folder and a Slurm job's)."""
    live = launcher("hpcjobs")
    try:
        killed = folder(tmp_path / "shm", local_id(dead_pid()))
        running, slurms = folder(tmp_path / "shm", local_id(live.pid)), folder(tmp_path / "shm", "4242")
        (tmp_path / "hello.py").write_text(SCRIPT)
        out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--no-snapshot", "--run-dir",
                      str(tmp_path / "run"), "hello.py", cwd=tmp_path, env=tier_env(tmp_path))
        assert out.returncode == 0, out.stderr
        assert not killed.exists() and running.exists() and slurms.exists(), out.stderr
        assert "removed 1 folder(s) of jobs that ended without removing them" in out.stderr
        assert str(killed) in out.stderr and "4242" not in out.stderr
    finally:
        live.kill()
        live.wait()


def test_the_folder_named_is_the_one_the_tier_writes(tmp_path: Path) -> None:
    assert job_folder("57_1", tier_env(tmp_path)) == tmp_path / "shm" / f"{PREFIX}57_1"
