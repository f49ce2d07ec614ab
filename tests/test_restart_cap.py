"""The restart cap counts requeues without progress (issue 38): a job that commits a newer checkpoint between its
stops is requeued as often as it needs, one that keeps being stopped without progress ends failed with one line
naming the cause that repeats. The decision at a stop (trainers.preemption.finish_stop, trainers.standby.act) and
at a start (trainers.launch), from the run folder (hpcjobs.protocol.faultpolicy.restartcap), with scontrol stood in
for."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcjobs.protocol.contract import LaunchContract, Preemption
from hpcjobs.protocol.faultpolicy import restartcap
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import StopOutcome
from trainers import preemption, standby


class Scontrol:
    """scontrol's stand-in: every requeue succeeds and is remembered."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "JobId=7 JobState=RUNNING", "")


@pytest.fixture
def clean() -> Iterator[None]:
    preemption.reset()
    yield
    preemption.reset()


def commit(run: RunFolder, step: int) -> None:
    """A finished checkpoint of the shared trainer (or trainers.checkpoint) at `step`."""
    (run.checkpoints / f"step-{step}").mkdir(parents=True, exist_ok=True)


def stop(run: RunFolder, cap: int, requeues: int, rank: int = 0, signum: int = signal.SIGUSR1,
         scontrol: Scontrol | None = None) -> StopOutcome:
    """A start that the scheduler's `requeues`-th requeue began is stopped by the profile's signal, its checkpoint
    committed: what finish_stop decides (under Slurm, job 7; the restart number counts the requeues, as on Slurm
    without recoveries, so the old code counted the same)."""
    preemption.reset()
    preemption.request_stop(signum)
    contract = LaunchContract(run_dir=str(run.path), preemption=Preemption(signal="USR1", max_restarts=cap))
    env = {"SLURM_JOB_ID": "7", "RANK": str(rank), "HPCJOBS_RESTART": str(requeues),
           "SLURM_RESTART_COUNT": str(requeues)}
    return preemption.finish_stop(None, contract, env, scontrol or Scontrol())


def test_progress_is_the_newest_checkpoint_whoever_wrote_it(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    assert restartcap.progress(run) == restartcap.progress(None) == restartcap.NONE
    commit(run, 30)
    (run.checkpoints / "step-99.tmp").mkdir()  # a save in flight is no progress
    assert restartcap.progress(run) == 30
    run.script_checkpoint.write_text(json.dumps({"path": "out/checkpoint-45", "step": 45}))  # integrations' marks
    assert restartcap.progress(run) == 45
    run.script_checkpoint.write_text("{not json")
    assert restartcap.progress(run) == 30


def test_a_job_in_time_limit_chunks_that_advances_is_requeued_past_the_cap(tmp_path: Path, clean: None) -> None:
    """Issue 38's job: 600 steps, cap 5, stopped at each time limit at steps 67, 110, 157, 194, 269, 546 (the old
    code ended it FAILED "restart cap 5 reached (timeout)" at the sixth stop), then twelve more chunks."""
    run, scontrol = RunFolder(tmp_path), Scontrol()
    stops = [67, 110, 157, 194, 269, 546, *range(550, 562)]
    for requeues, step in enumerate(stops):
        commit(run, step)
        assert stop(run, 5, requeues, scontrol=scontrol) == StopOutcome.REQUEUED, (requeues, step)
    assert len(scontrol.calls) == len(stops) and not run.final.exists()
    assert [asdict_row(r) for r in restartcap.recorded(run, "7")] == [(len(stops), 561)]  # the row keeps one


def asdict_row(r: restartcap.Requeue) -> tuple[int, int]:
    return r.requeue, r.step


def test_a_job_stopped_three_times_without_progress_ends_failed_naming_the_cause(tmp_path: Path,
                                                                                  clean: None) -> None:
    run, scontrol = RunFolder(tmp_path), Scontrol()
    commit(run, 12)
    assert stop(run, 2, 0, scontrol=scontrol) == StopOutcome.REQUEUED  # its first chunk got to step 12
    assert stop(run, 2, 1, scontrol=scontrol) == StopOutcome.REQUEUED  # nothing newer since
    assert stop(run, 2, 2, scontrol=scontrol) == StopOutcome.CAP
    assert len(scontrol.calls) == 2
    final = json.loads(run.final.read_text())
    assert final["state"] == "failed"
    assert final["reason"] == ("restart cap 2 reached (preemption): 2 requeues in a row brought no checkpoint newer "
                               "than step 12; stopped each time by: preemption")


def test_progress_between_stops_resets_the_count(tmp_path: Path, clean: None) -> None:
    run, scontrol = RunFolder(tmp_path), Scontrol()
    outcomes = []
    for requeues, step in enumerate([None, None, 5, None, 9, None, None]):
        if step is not None:
            commit(run, step)
        outcomes.append(stop(run, 2, requeues, scontrol=scontrol))
    # two requeues without a checkpoint; step 5 resets the count, one more without; step 9 resets it again, and two
    # requeues after it bring nothing newer: the cap is reached (the old code ended the job at the third stop)
    assert outcomes == [StopOutcome.REQUEUED] * 6 + [StopOutcome.CAP]
    reason = json.loads(run.final.read_text())["reason"]
    assert "2 requeues in a row brought no checkpoint newer than step 9" in reason


def test_a_stop_before_any_checkpoint_names_the_beginning(tmp_path: Path, clean: None) -> None:
    run = RunFolder(tmp_path)
    assert [stop(run, 1, n) for n in range(2)] == [StopOutcome.REQUEUED, StopOutcome.CAP]
    assert "1 requeue in a row brought no checkpoint newer than the beginning (none committed yet)" in \
        json.loads(run.final.read_text())["reason"]
    assert stop(RunFolder(tmp_path / "zero"), 0, 0) == StopOutcome.CAP  # max_restarts 0 never requeues
    assert "max_restarts 0 never requeues" in json.loads((tmp_path / "zero" / "final.json").read_text())["reason"]


def test_every_rank_decides_alike_before_and_after_rank_0_recorded_the_requeue(tmp_path: Path, clean: None) -> None:
    run = RunFolder(tmp_path)
    commit(run, 3)
    stop(run, 1, 0)
    assert stop(run, 1, 1, rank=1) == StopOutcome.CAP  # rank 1 before rank 0 acts
    assert stop(run, 1, 1, rank=0) == StopOutcome.CAP
    assert stop(run, 1, 1, rank=1) == StopOutcome.CAP  # and after
    run2 = RunFolder(tmp_path / "b")
    commit(run2, 3)
    stop(run2, 1, 0)
    commit(run2, 4)
    assert [stop(run2, 1, 1, rank=r) for r in (1, 0, 1)] == [StopOutcome.REQUEUED] * 3


def test_another_job_in_the_same_run_folder_counts_afresh(tmp_path: Path, clean: None) -> None:
    run = RunFolder(tmp_path)
    restartcap.record(run, "6", restartcap.Requeue(1, -1, "timeout"), restartcap.Requeue(2, -1, "timeout"))
    assert restartcap.fruitless(run, "7", 2, -1) == []
    assert len(restartcap.fruitless(run, "6", 2, -1)) == 2


def test_without_a_run_folder_every_requeue_counts(clean: None) -> None:
    assert len(restartcap.fruitless(None, "7", 3, restartcap.NONE)) == 3


# --- the start after a requeue no stop decided ----------------------------------------------------------------------

def test_a_start_counts_requeues_no_stop_recorded(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    assert restartcap.at_start(run, "7", 0, write=True) == [] and not run.requeue_row.exists()
    row = restartcap.at_start(run, "7", 1, write=False)  # rank 1: the same row, nothing written
    assert [r.requeue for r in row] == [1] and not run.requeue_row.exists()
    assert restartcap.at_start(run, "7", 1, write=True) == row and restartcap.recorded(run, "7") == row
    assert row[0].cause == restartcap.OUTSIDE and not restartcap.reached(row[:-1], 1)
    row = restartcap.at_start(run, "7", 3, write=True)  # two more, neither recorded: both count
    assert [r.requeue for r in row] == [1, 2, 3] and restartcap.reached(row[:-1], 2)
    commit(run, 8)
    row = restartcap.at_start(run, "7", 3, write=True)  # a recovery's start after a checkpoint: nothing in a row
    assert row == []


def test_a_start_after_a_requeue_its_stop_recorded_adds_nothing(tmp_path: Path, clean: None) -> None:
    run = RunFolder(tmp_path)
    for requeues in range(12):
        commit(run, 10 * (requeues + 1))
        assert restartcap.at_start(run, "7", requeues, write=True)[:-1] == []
        assert stop(run, 2, requeues) == StopOutcome.REQUEUED
    assert [(r.requeue, r.step, r.cause) for r in restartcap.at_start(run, "7", 12, write=True)] == \
        [(12, 120, "preemption")]


# --- a script that has not joined the protocol (trainers.standby) ---------------------------------------------------

def test_a_script_whose_integration_commits_checkpoints_is_requeued_past_the_cap(tmp_path: Path,
                                                                                 capfd: pytest.CaptureFixture[str],
                                                                                 ) -> None:
    run = RunFolder(tmp_path)
    contract = LaunchContract(run_dir=str(tmp_path), preemption=Preemption(signal="USR1", max_restarts=2))
    scontrol = Scontrol()
    for requeues in range(6):
        run.script_checkpoint.write_text(json.dumps({"path": "x", "step": 100 * requeues}))
        env = {"SLURM_JOB_ID": "7", "RANK": "0", "SLURM_RESTART_COUNT": str(requeues)}
        assert standby.act(signal.SIGUSR1, contract, env, scontrol) == StopOutcome.REQUEUED
    env = {"SLURM_JOB_ID": "7", "RANK": "0", "SLURM_RESTART_COUNT": "6"}
    assert standby.act(signal.SIGUSR1, contract, env, scontrol) == StopOutcome.REQUEUED  # one without progress
    env["SLURM_RESTART_COUNT"] = "7"
    assert standby.act(signal.SIGUSR1, contract, env, scontrol) == StopOutcome.CAP
    assert "restart cap 2 reached (preemption): 2 requeues in a row brought no checkpoint newer than step 500" in \
        capfd.readouterr().err
    assert len(scontrol.calls) == 7
