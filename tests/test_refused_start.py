"""A start its ranks refused (issue 38, item 2): a resume whose checkpoint was written with other settings exits 2
with one line in rank 0's log and writes no end into the run folder. It read FAILED ("its processes are gone, with no
final word: killed?") in status and list, and goodput counted it as a lost start (an interruption, a fault in its
checkpoint-interval advice). It is REFUSED now, with its line, and neither."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from conftest import hpcjobs
from hpcjobs.backends.slurm.sbatch import job_comment
from hpcjobs.backends.slurm.slurm import SlurmBackend
from hpcjobs.follow.refused import refusal
from hpcjobs.follow.status import status_of
from hpcjobs.goodput.records import read_starts
from hpcjobs.jobs.store import JobRecord
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import JobState

LINE = ("checkpoint /x/run/checkpoints/step-6 was written with other settings (task config: hidden 256 → 64); "
        "resuming would not continue the same run. HINT: use the same settings, or a new --run-dir.")


@pytest.mark.train
def test_a_resume_refused_for_other_settings_is_refused_not_failed_nor_a_fault(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run), "trainers.tasks.classifier",
            "--steps", "6", "--log-every", "3"]
    assert hpcjobs(*args, cwd=tmp_path).returncode == 0
    again = hpcjobs(*args, "--hidden", "64", cwd=tmp_path)  # another task config: known on the ranks only
    assert again.returncode == 2 and "was written with other settings" in again.stdout, again.stdout
    rows = json.loads(hpcjobs("list", "--json").stdout)
    assert [r["state"] for r in rows] == ["REFUSED", "COMPLETED"], rows
    assert "was written with other settings" in rows[0]["final_reason"], rows[0]
    shown = hpcjobs("status", rows[0]["job_id"]).stdout
    assert "REFUSED" in shown and "refused:" in shown and "would not continue the same run" in shown, shown
    assert "FAILED" not in shown and "killed" not in shown, shown
    report = json.loads(hpcjobs("goodput", str(run), "--json").stdout)
    assert [j["interruptions"] for j in report["jobs"]] == [0, 0], report["jobs"]
    assert [s.ended for _, s in read_starts(RunFolder(run))] == ["finished", "refused"]
    assert "--ckpt-every" not in hpcjobs("goodput", str(run)).stdout


def refused_run(tmp_path: Path, last: str = f"hpcjobs: {LINE}") -> RunFolder:
    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    run.record_start(0, "42", 2, host="node1", master="node1:29500")
    log = run.rank_log(0, 0)
    log.parent.mkdir(parents=True)
    log.write_text("hpcjobs: rank 0/2 (local 0) on node1, job 42 restart 0\n[hpcjobs rank 0] task lm\n" + last + "\n")
    return run


def slurm_runner(run: RunFolder, exit_code: str) -> SlurmBackend:
    def answer(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        words = list(argv)
        if words[0] == "sacct" and words[-1] == "State,Comment":
            return subprocess.CompletedProcess(words, 0, f"FAILED|{job_comment(str(run.path))}\n", "")
        if words[0] == "sacct" and words[-1] == "ExitCode":
            return subprocess.CompletedProcess(words, 0, f"{exit_code}\n", "")
        if words[0] == "squeue":
            return subprocess.CompletedProcess(words, 1, "", "slurm_load_jobs error: Invalid job id specified")
        return subprocess.CompletedProcess(words, 1, "", "")
    return SlurmBackend(answer)


def record(run: RunFolder, logs: dict[str, str] | None = None) -> JobRecord:
    return JobRecord("42", "lm", "mysite", "slurm", 1, 2, str(run.path), logs or {}, {}, 0.0)


def test_on_slurm_sacct_exit_code_2_and_the_line_in_rank_0s_log_are_refused(tmp_path: Path) -> None:
    run = refused_run(tmp_path)
    st = status_of(record(run), slurm_runner(run, "2:0"))
    assert (st.state, st.final_reason) == (JobState.REFUSED, LINE), st
    assert status_of(record(run), slurm_runner(run, "1:0")).state == JobState.FAILED  # submitit's own exit code…


def test_under_submitit_its_words_for_a_rank_that_exited_2_stand_for_the_exit_code(tmp_path: Path) -> None:
    run = refused_run(tmp_path)
    out = tmp_path / "42_0_log.out"
    out.write_text("")
    out.with_suffix(".err").write_text("RuntimeError: hpcjobs rank exited with code 2; see the run folder's logs\n")
    assert refusal(record(run, {"slurm": str(out)}), run, slurm_runner(run, "1:0")) == LINE


def test_a_failure_or_a_kill_with_exit_code_2_is_no_refusal(tmp_path: Path) -> None:
    failed = refused_run(tmp_path, "hpcjobs: rank 0 failed: ValueError: bad (traceback in rank-0.log)")
    assert status_of(record(failed), slurm_runner(failed, "2:0")).state == JobState.FAILED
    (tmp_path / "b").mkdir()
    silent = refused_run(tmp_path / "b", "step 3 loss 1.0")
    assert refusal(record(silent), silent, slurm_runner(silent, "2:0")) is None
