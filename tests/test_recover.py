"""The recovery inside the allocation (trainers/recover.py), off the cluster: a fake step (a Python script standing
in for srun, writing what the ranks write) and recorded Slurm answers (scontrol, sinfo) through the injected runner.
The real thing, a rank SIGKILLed on the test cluster, is in tests/cluster/test_faults_cluster.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import REPO, hpcjobs
from hpcjobs.protocol.contract import LaunchContract, Recovery
from hpcjobs.protocol.runfolder import RunFolder
from trainers import checkpoint, recover
from trainers.checkpoint.dcp_files import model_weights

STEP = """
import json, os, sys, time
from hpcjobs.protocol.runfolder import RunFolder, append_jsonl
run = RunFolder(sys.argv[1])
restart = int(os.environ["HPCJOBS_RESTART"])
plan = json.loads(sys.argv[2])  # per start: ok, peer, task, silent, stop, or a checkpoint step to make first
what = plan[min(restart, len(plan) - 1)]
run.record_start(restart, "42", 2)
append_jsonl(run.path / "ends.jsonl", {"restart": restart, "end": os.environ.get("SLURM_JOB_END_TIME")})
if isinstance(what, int):
    (run.checkpoints / f"step-{what}").mkdir(parents=True, exist_ok=True)
    what = "peer"
if what == "stop":  # the protocol stopped it (a preemption); a rank failed on its way out
    run.record_stop("preemption", 40, restart)
    what = "peer"
errors = {"peer": "RuntimeError: [Gloo] Connection closed by peer", "task": "ValueError: bad batch"}
if what in errors:
    append_jsonl(run.failures, {"time": time.time(), "job_id": "42", "restart": restart, "rank": 1,
                                "host": "node2", "error": errors[what]})
if what == "stuck":  # a rank recorded its failure, and the step does not end (a node that does not answer)
    append_jsonl(run.failures, {"time": time.time(), "job_id": "42", "restart": restart, "rank": 0,
                                "host": "node1", "error": "RuntimeError: [Gloo] Connection closed by peer"})
    time.sleep(120)
if what == "dead":  # node2 died: node1's ranks both recorded losing it, node2's never will; srun waits on
    for rank in range(4):  # a node that does not answer
        append_jsonl(run.startup, {"job_id": "42", "restart": restart, "rank": rank, "host": f"node{1 + rank // 2}"})
    for rank in (0, 1):
        append_jsonl(run.failures, {"time": time.time(), "job_id": "42", "restart": restart, "rank": rank,
                                    "host": "node1", "error": "RuntimeError: [Gloo] Connection closed by peer"})
    time.sleep(120)
sys.exit(0 if what == "ok" else 1)
"""


class Slurm:
    """scontrol and sinfo as the test cluster answers them; every command asked is kept."""

    def __init__(self, down: Sequence[str] = (), state: str = "RUNNING", end: str = "") -> None:
        self.down, self.state, self.asked = list(down), state, []  # type: list[str], str, list[list[str]]
        self.end = end

    def __call__(self, cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        self.asked.append(cmd)
        if cmd[:3] == ["scontrol", "show", "job"]:
            out = f"JobId=42 JobName=lm JobState={self.state} Restarts=0" if self.state else ""
            out += f" EndTime={self.end}" if self.end and out else ""
        elif cmd[0] == "sinfo":
            nodes = cmd[cmd.index("-n") + 1].split(",")
            out = "\n".join(f"{n}|down*|Not responding" if n in self.down else f"{n}|alloc|none" for n in nodes)
        else:
            out = ""
        return subprocess.CompletedProcess(cmd, 0, out, "")


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.delenv("HPCJOBS_RESTART", raising=False)
    monkeypatch.setattr(recover, "_ended", [])
    yield tmp_path / "run"


DEFAULTS = Recovery()


def step(run: Path, plan: list[Any], recovery: Recovery = DEFAULTS) -> list[str]:
    run.mkdir(exist_ok=True)
    script = run.parent / "step.py"
    script.write_text(STEP)
    contract = LaunchContract(run_dir=str(run), recovery=recovery)
    return [sys.executable, str(script), str(run), json.dumps(plan), "--contract", contract.to_json()]


def tmp_path_of(run: Path, name: str = "a") -> Path:
    """Another run folder beside `run`."""
    return run.parent / f"{run.name}-{name}"


def faults(run: Path) -> list[dict[str, Any]]:
    return [r for r in RunFolder(run).read_restarts() if r.get("stopped") == "fault"]


def test_a_lost_peer_is_recovered_in_the_allocation_as_a_new_numbered_start(job: Path) -> None:
    slurm = Slurm()
    assert recover.supervise(step(job, ["peer", "ok"]), slurm) == 0
    starts = [r["restart"] for r in RunFolder(job).read_restarts() if "stopped" not in r]
    assert starts == [0, 1]  # the recovery's start has a number of its own: its own logs
    [fault] = faults(job)
    assert (fault["restart"], fault["recovery"], fault["how"], fault["exclude"], fault["step"]) == \
        (0, 1, "allocation", [], -1)
    assert "rank 1 on node2: RuntimeError: [Gloo] Connection closed by peer" in fault["cause"]
    assert not any(c[:2] == ["scontrol", "requeue"] for c in slurm.asked)


def test_a_step_that_goes_on_after_a_rank_failed_is_ended_and_recovered(job: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recover, "STUCK_S", 0.5)
    began = time.monotonic()
    assert recover.supervise(step(job, ["stuck", "ok"]), Slurm()) == 0
    assert time.monotonic() - began < 60  # not the stuck step's 120 s
    [fault] = faults(job)
    assert "Connection closed by peer" in fault["cause"]


def test_a_step_whose_speaking_ranks_all_said_why_is_ended_without_waiting_out_the_stuck_bound(
        job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node2 dies: node1's ranks record losing it, node2's never speak. The step is ended once those that can speak
    have said why (SAID_S), not after STUCK_S: the node death's recovery time."""
    monkeypatch.setattr(recover, "STUCK_S", 60.0)
    began = time.monotonic()
    assert recover.supervise(step(job, ["dead", "ok"]), Slurm()) == 0
    assert time.monotonic() - began < 30  # not STUCK_S's 60 s
    [fault] = faults(job)
    assert "Connection closed by peer" in fault["cause"]


@pytest.mark.parametrize("said,expected", [((), False), ((0,), False), ((0, 1), True), ((0, 1, 2), False),
                                           ((0, 1, 2, 3), True), ((2, 3), True)])
def test_all_said_once_every_host_has_all_or_none_of_its_ranks_recorded(tmp_path: Path, said: tuple[int, ...],
                                                                       expected: bool) -> None:
    from hpcjobs.protocol.faultpolicy.recoverable import all_said
    from hpcjobs.protocol.runfolder import append_jsonl
    run = RunFolder(tmp_path)
    for rank in range(4):
        append_jsonl(run.startup, {"job_id": "42", "restart": 1, "rank": rank, "host": f"node{1 + rank // 2}"})
    for rank in said:
        append_jsonl(run.failures, {"time": 1.0, "job_id": "42", "restart": 1, "rank": rank})
    append_jsonl(run.failures, {"time": 1.0, "job_id": "42", "restart": 0, "rank": 3})  # another start's
    assert all_said(run, "42", 1) is expected
    assert not all_said(run, "42", 2)  # nothing known of a start that has no lines


TIMED_OUT = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation"


@pytest.mark.parametrize("records,expected", [
    ({0: TIMED_OUT, 1: TIMED_OUT, 2: TIMED_OUT}, True),  # rank 3 hung (SIGSTOPped): the others all waited for it
    ({0: TIMED_OUT, 1: "hung: no step progress for 300 s"}, True),
    ({0: TIMED_OUT, 1: TIMED_OUT, 2: "RuntimeError: Connection closed by peer"}, False),  # node2 part-way: wait
    ({2: "ValueError: bad batch"}, False)])
def test_all_said_when_every_record_waited_for_the_ranks_that_said_nothing(tmp_path: Path, records: dict[int, str],
                                                                          expected: bool) -> None:
    """A hung rank never speaks while SIGSTOPped, and its node's other ranks did: only the records' words tell that
    the silent one is the one they waited for (its step went on 8.6 s past their timeouts on the test cluster)."""
    from hpcjobs.protocol.faultpolicy.recoverable import all_said
    from hpcjobs.protocol.runfolder import append_jsonl
    run = RunFolder(tmp_path)
    for rank in range(4):
        append_jsonl(run.startup, {"job_id": "42", "restart": 0, "rank": rank, "host": f"node{1 + rank // 2}"})
    for rank, error in records.items():
        append_jsonl(run.failures, {"time": 1.0, "job_id": "42", "restart": 0, "rank": rank, "error": error})
    assert all_said(run, "42", 0) is expected


@pytest.mark.parametrize("scontrol_says", [True, False])
def test_a_relaunched_step_ends_when_the_job_does_not_a_time_limit_after_its_own_start(
        job: Path, monkeypatch: pytest.MonkeyPatch, scontrol_says: bool) -> None:
    """Slurm 22.05 sets no SLURM_JOB_END_TIME: a relaunched step's ranks counted the limit from their own start and
    would stop after Slurm had ended the job. They get the job's end: scontrol's EndTime, else the recovery's start
    plus the limit."""
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    began = time.time()
    argv = step(job, ["peer", "ok"])
    contract = LaunchContract.from_json(argv[-1])
    argv[-1] = replace(contract, time_limit_s=3600).to_json()
    assert recover.supervise(argv, Slurm(end="2026-11-26T03:00:00" if scontrol_says else "")) == 0
    ends = {r["restart"]: r["end"] for r in map(json.loads, (job / "ends.jsonl").read_text().splitlines())}
    assert ends[0] is None  # the first step: the batch script's environment, as Slurm gave it
    if scontrol_says:
        assert int(ends[1]) == int(time.mktime(time.strptime("2026-11-26T03:00:00", "%Y-%m-%dT%H:%M:%S")))
    else:
        assert began + 3600 - 1 <= int(ends[1]) <= time.time() + 3600


def test_a_tasks_own_exception_is_never_recovered(job: Path) -> None:
    assert recover.supervise(step(job, ["task", "ok"]), Slurm()) == 1
    assert faults(job) == [] and len(RunFolder(job).read_restarts()) == 1


def test_no_new_checkpoint_across_max_recoveries_ends_the_job_failed_naming_the_cause(job: Path,
                                                                                     capsys: Any) -> None:
    assert recover.supervise(step(job, ["peer"], Recovery(max_recoveries=2)), Slurm()) == 1
    assert len(faults(job)) == 2
    final = json.loads((job / "final.json").read_text())
    assert final["state"] == "failed" and "no new checkpoint across 2 recoveries in a row" in final["reason"]
    assert "Connection closed by peer" in final["reason"]
    assert "ends failed: no new checkpoint across 2" in capsys.readouterr().err


def test_a_job_that_makes_checkpoints_between_faults_goes_on_recovering(job: Path) -> None:
    """Three faults with max_recoveries 1: each came after a new checkpoint, so none is a repeat without progress."""
    assert recover.supervise(step(job, [10, 20, 30, "ok"], Recovery(max_recoveries=1)), Slurm()) == 0
    assert [f["step"] for f in faults(job)] == [10, 20, 30]


def test_a_down_node_without_a_spare_requeues_the_job_with_it_left_out(job: Path) -> None:
    slurm = Slurm(down=["node2"])
    assert recover.supervise(step(job, ["peer", "ok"]), slurm) == 0
    [fault] = faults(job)
    assert (fault["how"], fault["exclude"]) == ("requeue", ["node2"])
    assert fault["cause"].startswith("node node2 is not responding (rank 1 on node2: "), fault  # not sinfo's "down*"
    assert ["scontrol", "update", "JobId=42", "ExcNodeList=node2"] in slurm.asked
    assert ["scontrol", "requeue", "42"] in slurm.asked
    assert [r["restart"] for r in RunFolder(job).read_restarts() if "stopped" not in r] == [0]  # Slurm starts it


def test_a_spare_node_stands_in_for_a_down_one(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-3]")
    assert recover.supervise(step(job, ["peer", "ok"], Recovery(spare_nodes=1)), Slurm(down=["node3"])) == 0
    [fault] = faults(job)
    assert (fault["how"], fault["exclude"]) == ("allocation", ["node3"])
    alloc = recover.Allocation("42", ["node1", "node2", "node3"], 1)
    assert recover.step_argv(["srun", "--nodes=2", "x"], alloc, ["node3"]) == \
        ["srun", "--overlap", "--exclude=node3", "--nodes=2", "x"]


@pytest.mark.parametrize("why", ["scancelled", "no answer", "stopped by the protocol", "recovery off"])
def test_nothing_is_recovered_when_the_job_is_being_ended(job: Path, why: str) -> None:
    first = "stop" if why == "stopped by the protocol" else "peer"
    argv = step(job, [first, "ok"], Recovery(max_recoveries=0 if why == "recovery off" else 3))
    slurm = Slurm(state={"scancelled": "CANCELLED", "no answer": ""}.get(why, "RUNNING"))
    assert recover.supervise(argv, slurm) == 1
    assert faults(job) == []


def test_the_next_start_number_counts_every_start_the_folder_has_seen(job: Path) -> None:
    run = RunFolder(job)
    assert run.next_restart() == 0
    run.record_start(0, "41", 2)
    run.record_stop("fault", -1, 0, recovery=1)
    run.record_start(1, "41", 2)
    assert run.next_restart() == 2


LM = ["trainers.tasks.lm", "--size", "tiny", "--steps", "60", "--log-every", "10", "--ckpt-every", "20"]


def local_job(tmp: Path, name: str, **env: str) -> tuple[subprocess.CompletedProcess[str], RunFolder]:
    """2 ranks on the local profile with the hang bound at its floor (5 s) and the collective timeout far longer."""
    profile = tmp / "p.yaml"
    if not profile.exists():
        data = yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())
        profile.write_text(yaml.safe_dump({**data, "recovery": {"hang_min_s": 5}}))
    run = RunFolder(tmp / name)
    out = hpcjobs("submit", "--profile", str(profile), "--gpus", "2", "--run-dir", str(run.path), *LM, cwd=REPO,
                  timeout=600, env={"HPCJOBS_HOME": str(tmp / "home"), "HPCJOBS_COLLECTIVE_TIMEOUT": "600", **env})
    return out, run


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out, run = local_job(tmp_path_factory.mktemp("twin"), "twin")
    assert out.returncode == 0, out.stderr
    ref = checkpoint.latest(run.checkpoints)
    assert ref is not None and ref.step == 60
    return model_weights(ref)


@pytest.mark.train
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_the_local_profile_recovers_a_killed_or_hung_rank_with_an_uninterrupted_runs_weights(
        tmp_path: Path, twin: dict[str, torch.Tensor], fault: str) -> None:
    """Rank 1 SIGKILLed, or SIGSTOPped (a hang: the watchdogs fire, every rank leaves its stacks), at step 30 of the
    first start only: the local backend starts the ranks again from step 20, as the Slurm batch step does (the killed
    one alone, its peer keeping its process)."""
    out, run = local_job(tmp_path, "run", HPCJOBS_FAULT_INJECT="step@30:1", HPCJOBS_FAULT_ACTION=fault,
                         HPCJOBS_FAULT_RESTART="0")
    assert out.returncode == 0, out.stderr
    [line] = [r for r in run.read_restarts() if r.get("stopped") == "fault"]
    # step 20's checkpoint is saved in the background: under load it may not be committed by step 30
    # a killed rank is replaced while the other keeps its process (tests/test_rejoin.py); a hang restarts both
    how, where = ("rejoin", "in place") if fault == "kill" else ("local", "on this machine from ")
    assert (line["how"], line["restart"]) == (how, 0) and line["step"] in (20, -1), line
    assert "hpcjobs: recovery 1 of job" in out.stderr and where in out.stderr
    if fault == "kill":  # named by the launcher, as srun names it: not the peer that lost it
        assert "rank 1 on " in line["cause"] and "killed by SIGKILL" in line["cause"], line
    if fault == "stop":
        assert "hung:" in line["cause"]
        # the healthy rank's watchdog fired first; the stopped one's own dump (once continued) is the watchdog's test
        assert "hung: no step progress" in run.stack_file(0, 0).read_text()
    ref = checkpoint.latest(run.checkpoints)
    assert ref is not None and ref.step == 60
    got = model_weights(ref)
    assert got.keys() == twin.keys() and all(torch.equal(got[k], twin[k]) for k in got)


def test_submitits_call_runs_the_step_under_the_recovery_with_the_nodes_python(job: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What submitit runs in the batch script (use_srun=False): the step, `"$HPCJOBS_PYTHON"` put in by value."""
    from hpcjobs.protocol.nodecall import NODE_PYTHON, SupervisedStep

    monkeypatch.setenv("HPCJOBS_PYTHON", sys.executable)
    argv = step(job, ["ok"])
    assert SupervisedStep([NODE_PYTHON, *argv[1:]])() == 0
    assert [r["restart"] for r in RunFolder(job).read_restarts()] == [0]
    asked: list[Any] = []  # Slurm's answers, with the command runner the recovery asks them through
    monkeypatch.setattr(recover, "job_fields", lambda _job, runner: asked.append(runner) or {"JobState": "RUNNING"})
    monkeypatch.setattr(recover, "unhealthy_nodes", lambda _nodes, runner: asked.append(runner) or {})
    monkeypatch.setattr(recover, "stated_end_env", lambda _job, _env, _end, runner: asked.append(runner) or {})
    assert SupervisedStep([NODE_PYTHON, *step(tmp_path_of(job), ["peer", "ok"])[1:]])() == 0
    assert asked == [subprocess.run] * 3  # the job's state, the nodes' health, the job's end
    with pytest.raises(RuntimeError, match="exited with code 1"):
        SupervisedStep([NODE_PYTHON, *step(tmp_path_of(job, "b"), ["task"])[1:]])()


@pytest.mark.train
def test_a_fault_that_comes_back_at_every_start_ends_the_job_after_max_recoveries(tmp_path: Path) -> None:
    """Rank 1 killed at step 10 of every start, before the first checkpoint (step 20): no start makes progress, so
    after `--max-recoveries 2` the job ends FAILED with one line naming the cause that repeats."""
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())))
    run = RunFolder(tmp_path / "run")
    out = hpcjobs("submit", "--profile", str(profile), "--gpus", "2", "--run-dir", str(run.path), "--max-recoveries",
                  "2", *LM, cwd=REPO, timeout=600, env={"HPCJOBS_HOME": str(tmp_path / "home"),
                                                        "HPCJOBS_FAULT_INJECT": "step@10:1"})
    assert out.returncode != 0
    assert [r["recovery"] for r in run.read_restarts() if r.get("stopped") == "fault"] == [1, 2]
    [line] = [ln for ln in out.stderr.splitlines() if "ends failed: no new checkpoint across 2 recoveries" in ln]
    assert "each time:" in line and "rank 1" in line, line
    final = json.loads((run.path / "final.json").read_text())
    assert final["state"] == "failed" and "no new checkpoint across 2 recoveries" in final["reason"]
