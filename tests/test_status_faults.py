"""`hpcjobs status` tells the truth about faults (issue 27 item 4): which node failed and why (Slurm's NODE_FAIL,
FailedNode= and the node's own Reason=, with the ranks' records), Slurm's restart count while a requeued job waits,
the job's recoveries, and never the healthy peer's "Connection reset" as the cause. Slurm's answers are fed through
the backend's Runner, in the form Slurm 22.05 prints them (tests/golden/testcluster-scontrol-node.txt; the job lines
follow slurmctld's job_mgr.c for a node that fails under a requeueable batch job)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hpcjobs.backends.local.local import LocalBackend
from hpcjobs.backends.slurm.failed_nodes import slurm_facts
from hpcjobs.backends.slurm.sbatch import job_comment
from hpcjobs.backends.slurm.slurm import SlurmBackend
from hpcjobs.cli import present
from hpcjobs.follow.status import status_of
from hpcjobs.goodput.compare import folder_only_state
from hpcjobs.jobs.store import JobRecord
from hpcjobs.protocol.runfolder import RunFolder, append_jsonl
from hpcjobs.protocol.states import FinalState, JobState, StopReason

FAILED_AT = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 30))
"""When Slurm ended the allocation NODE_FAIL (sacct's EndTime, local time): after the start node_died() records.
Taken when the module is collected: node_died() dates its records from it, not from the time a test runs (a full
suite runs an hour after collecting)."""
FAILED_EPOCH = time.mktime(time.strptime(FAILED_AT, "%Y-%m-%dT%H:%M:%S"))
GOLDEN = Path(__file__).resolve().parent / "golden"
NODE1 = (GOLDEN / "testcluster-scontrol-node.txt").read_text().splitlines()[0]
NODE2_DOWN = (GOLDEN / "testcluster-scontrol-node.txt").read_text().splitlines()[1].replace(
    "State=IDLE", "State=DOWN*").replace("CPULoad=3.21", "CPULoad=N/A") + \
    f" Reason=Not responding [slurm@{FAILED_AT}]"
NODE2_BACK = (GOLDEN / "testcluster-scontrol-node.txt").read_text().splitlines()[1]
JOB = ("JobId=42 JobName=lm UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 Account=(null) "
       "QOS=(null) JobState={state} Reason={reason} {failed}Dependency=(null) Requeue=1 Restarts={restarts} "
       "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:04:05 TimeLimit=00:30:00 TimeMin=N/A "
       "SubmitTime=2026-11-25T10:00:00 EligibleTime=2026-11-25T10:00:00 AccrueTime=2026-11-25T10:00:00 "
       "StartTime=2026-11-25T10:00:07 EndTime={end} Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
       "Partition=low AllocNode:Sid=head:1234 ReqNodeList=(null) ExcNodeList=(null) NodeList={nodes} "
       "BatchHost=node1 NumNodes=2-2 NumCPUs=4 NumTasks=4 CPUs/Task=1 TRES=cpu=4,mem=1G,node=2,billing=4 "
       "Comment={comment} StdIn=/dev/null TresPerNode=gres:gpu:2")
CONNECTION_RESET = "DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer"


class Slurm:
    """A runner answering squeue, scontrol show job/node and sacct as Slurm printed them; remembers what was asked."""

    def __init__(self, **answers: tuple[int, str]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        key = "_".join(argv[:3]) if argv[0] == "scontrol" else argv[0]
        rc, out = self.answers.get(key, (1, ""))
        return subprocess.CompletedProcess(list(argv), rc, out, "" if rc == 0 else f"{argv[0]}: error\n")


def job_line(rec: JobRecord, state: str, reason: str = "None", restarts: int = 0, failed: str = "",
             end: str = "Unknown", nodes: str = "node[1-2]") -> str:
    return JOB.format(state=state, reason=reason, restarts=restarts, failed=f"FailedNode={failed} " if failed else "",
                      end=end, nodes=nodes, comment=job_comment(rec.run_dir)) + "\n"


def record(tmp_path: Path) -> JobRecord:
    return JobRecord(job_id="42", name="lm", profile="p", scheduler="slurm", nodes=2, gpus_per_node=2,
                     run_dir=str(tmp_path / "run"), logs={}, spec={}, submitted=time.time())


def first_start(rec: JobRecord, step: int) -> RunFolder:
    """Start 0 of the job: 2 nodes × 2 ranks, each rank's log up to `step`."""
    run = RunFolder(rec.run_dir)
    append_jsonl(run.restarts, {"time": FAILED_EPOCH - 270, "restart": 0, "job_id": "42", "world_size": 4})
    for rank in range(4):
        run.rank_log(0, rank).parent.mkdir(parents=True, exist_ok=True)
        run.rank_log(0, rank).write_text(f"hpcjobs: rank {rank}/4 (local {rank % 2}) on node{1 + rank // 2}, job 42 "
                                         f"restart 0, ...\nstep {step} | loss 2.0\n")
    return run


def node_died(rec: JobRecord) -> RunFolder:
    """node2 killed at step ~285 with its link up: ranks 0 and 1 on node1 saw their connections reset, ranks 2 and 3
    wrote nothing, and the first failure's words went into final.json."""
    run = first_start(rec, 280)
    now = FAILED_EPOCH - 20  # the peers saw their connections reset before Slurm declared the node dead
    for rank in (1, 0):
        append_jsonl(run.failures, {"time": now + rank, "job_id": "42", "restart": 0, "rank": rank, "host": "node1",
                                    "error": CONNECTION_RESET, "log": str(run.rank_log(0, rank))})
    run.write_final(FinalState.FAILED, f"rank 1 on node1: {CONNECTION_RESET} (log: ...)", job_id="42")
    return run


def test_a_requeued_job_waiting_after_its_node_failed_names_the_node_and_slurms_restart_count(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Measured on the test cluster: status said restarts 0 (Slurm: 1) and `ended: rank 1 on node1: ... Connection
    reset by peer` (the healthy node) while the job waited to be requeued, and never named node2."""
    rec = record(tmp_path)
    node_died(rec)
    slurm = Slurm(squeue=(0, f"PENDING|{job_comment(rec.run_dir)}\n"),
                  scontrol_show_job=(0, job_line(rec, "PENDING", "BeginTime", 1, nodes="(null)")),
                  sacct=(0, f"NODE_FAIL|node[1-2]|{FAILED_AT}\nPENDING|None assigned|Unknown\n"),
                  scontrol_show_node=(0, f"{NODE1}\n{NODE2_DOWN}\n"))
    st = status_of(rec, SlurmBackend(slurm))
    assert (st.state, st.restarts, st.scheduler_restarts) == (JobState.PENDING, 1, 1)
    assert st.final_reason is None  # the failed start's words are not how the job ended: it starts again
    assert st.first_failure == (f"node node2 failed: Not responding [slurm@{FAILED_AT}] (sacct: the job's "
                                "allocation ended NODE_FAIL; Slurm requeued the job); ranks 2, 3 on it recorded "
                                "nothing"), st.first_failure
    assert st.node_faults == (f"node2: Not responding [slurm@{FAILED_AT}] (sacct: the job's allocation ended "
                              "NODE_FAIL; Slurm requeued the job)",)
    assert ["scontrol", "show", "node", "-o", "node1,node2"] in slurm.calls
    present.status(st, None)
    out = capsys.readouterr().out
    assert "Connection reset" not in out and "ended:" not in out, out
    assert "node failed: node2: Not responding" in out and "restarts:    1\n" in out, out


def test_a_node_failure_while_slurm_cleans_up_and_after_the_node_came_back(tmp_path: Path) -> None:
    """The requeue's first seconds: COMPLETING with FailedNode= (accounting not asked for a name it does not keep).
    Once the node is back its reason is gone: the ranks' silence still names it."""
    rec = record(tmp_path)
    node_died(rec)
    completing = job_line(rec, "COMPLETING", "None", 1, failed="node2", end=f"{FAILED_AT}")
    facts = slurm_facts("42", Slurm(scontrol_show_job=(0, completing),
                                    scontrol_show_node=(0, f"{NODE2_DOWN}\n")))
    assert facts.restarts == 1 and [f.nodes for f in facts.node_faults] == [("node2",)]
    assert facts.node_faults[0].said == "scontrol: JobState=COMPLETING Reason=None FailedNode=node2"
    back = Slurm(squeue=(0, f"PENDING|{job_comment(rec.run_dir)}\n"),
                 scontrol_show_job=(0, job_line(rec, "PENDING", "BeginTime", 1, nodes="(null)")),
                 sacct=(0, f"NODE_FAIL|node[1-2]|{FAILED_AT}\nPENDING|None assigned|Unknown\n"),
                 scontrol_show_node=(0, f"{NODE1}\n{NODE2_BACK}\n"))
    st = status_of(rec, SlurmBackend(back))
    assert st.first_failure is not None and st.first_failure.startswith(
        "node node2 failed: its reason is gone: the node is up again"), st.first_failure
    assert "ranks 2, 3 on it recorded nothing" in st.first_failure
    assert st.node_faults == ("node2: its reason is gone: the node is up again (sacct: the job's allocation ended "
                              "NODE_FAIL; Slurm requeued the job)",)  # sacct named node[1-2]: the ranks tell which


def test_a_job_that_ended_node_fail_is_diagnosed_with_its_node_not_the_peers_reset(tmp_path: Path) -> None:
    """Not requeued (--no-requeue): JobState=NODE_FAIL Reason=NodeDown FailedNode=node2 until MinJobAge."""
    rec = record(tmp_path)
    node_died(rec)
    slurm = Slurm(squeue=(0, f"NODE_FAIL|{job_comment(rec.run_dir)}\n"),
                  scontrol_show_job=(0, job_line(rec, "NODE_FAIL", "NodeDown", 0, failed="node2",
                                                 end=f"{FAILED_AT}")),
                  sacct=(0, f"NODE_FAIL|node[1-2]|{FAILED_AT}\n"),
                  scontrol_show_node=(0, f"{NODE2_DOWN}\n"))
    st = status_of(rec, SlurmBackend(slurm))
    assert st.state == JobState.NODE_FAIL and st.restarts == 0
    assert st.first_failure == (f"node node2 failed: Not responding [slurm@{FAILED_AT}] (scontrol: "
                                "JobState=NODE_FAIL Reason=NodeDown FailedNode=node2); ranks 2, 3 on it recorded "
                                "nothing"), st.first_failure
    assert len(st.node_faults) == 1  # sacct's line about the same allocation is not a second failure


def test_slurms_restart_count_without_accounting_and_with_recoveries_in_the_allocation(tmp_path: Path) -> None:
    rec = record(tmp_path)
    run = node_died(rec)
    pending = job_line(rec, "PENDING", "BeginTime", 1, nodes="(null)")
    no_sacct = Slurm(squeue=(0, f"PENDING|{job_comment(rec.run_dir)}\n"), scontrol_show_job=(0, pending))
    assert status_of(rec, SlurmBackend(no_sacct)).restarts == 1
    # Two recoveries inside the allocation (starts 1 and 2) before the requeue: its next start is the 4th.
    for restart in (1, 2):
        run.record_stop(str(StopReason.FAULT), 200, restart - 1, recovery=restart, cause="rank 3 on node2: Killed",
                        how="allocation", exclude=[])
        run.record_start(restart, "42", 4)
    st = status_of(rec, SlurmBackend(no_sacct))
    assert (st.restarts, st.scheduler_restarts) == (3, 1)
    forgotten = Slurm(sacct=(0, f"NODE_FAIL|node[1-2]|{FAILED_AT}\nCOMPLETED|node[1-2]|"
                                "2026-11-25T10:20:00\n"))
    assert slurm_facts("42", forgotten).restarts == 1  # past MinJobAge: accounting's allocations less one
    quiet = Slurm(scontrol_show_job=(0, job_line(rec, "RUNNING")))
    assert slurm_facts("42", quiet).restarts == 0 and [c[0] for c in quiet.calls] == ["scontrol"]  # no sacct


def test_recoveries_show_with_their_cause_and_are_neither_a_stop_nor_the_jobs_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank killed, the job relaunched in its allocation without node2: the failed start's final.json word and
    its `fault` stop line must not make the running job look ended, failed or stopped."""
    rec = record(tmp_path)
    run = node_died(rec)
    run.record_stop(str(StopReason.FAULT), 280, 0, recovery=1, cause="rank 3 on node2: Killed (said by srun)",
                    how="allocation", exclude=["node2"])
    running = Slurm(squeue=(0, f"RUNNING|{job_comment(rec.run_dir)}\n"),
                    scontrol_show_job=(0, job_line(rec, "RUNNING")))
    st = status_of(rec, SlurmBackend(running))
    assert st.final_reason is None and st.recoveries == 1  # between the stop line and the next start too
    run.record_start(1, "42", 4)
    st = status_of(rec, SlurmBackend(running))
    assert (st.state, st.restarts, st.final_reason, st.first_failure) == (JobState.RUNNING, 1, None, None)
    assert (st.recoveries, st.last_recovery) == (1, "after restart 0: rank 3 on node2: Killed (said by srun); "
                                                    "relaunched in the allocation, leaving out node2, from step 280")
    present.status(st, None)
    out = capsys.readouterr().out
    assert "recoveries:  1; the last after restart 0: rank 3 on node2" in out and "ended:" not in out, out
    assert folder_only_state(run)[0] == JobState.UNKNOWN  # compare: still going, not STOPPED
    run.record_stop(str(StopReason.FAULT), 280, 1, recovery=2, cause="rank 0 on node1: Killed", how="requeue",
                    exclude=[], job_id="42")
    assert folder_only_state(run)[0] == JobState.UNKNOWN
    run.record_stop(str(StopReason.FAULT), 280, 1, recovery=1, cause="another job's", how="requeue", exclude=[],
                    job_id="43")
    st = status_of(rec, SlurmBackend(running))
    assert st.recoveries == 2 and st.last_recovery is not None and st.last_recovery.startswith(
        "after restart 1: rank 0 on node1: Killed; requeued, from step 280"), st.last_recovery


def test_a_local_job_has_no_scheduler_facts(tmp_path: Path) -> None:
    rec = record(tmp_path)
    facts = LocalBackend().scheduler_facts(rec)
    assert facts.restarts is None and facts.node_faults == ()


def test_a_job_that_completed_after_its_node_failed_names_that_node_not_the_ranks_slurm_killed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Measured on the test cluster: node2's link and processes killed; Slurm declared it dead (SlurmdTimeout), ended
    the allocation NODE_FAIL, killing node1's ranks too (none of the four recorded anything; srun named node1's
    tasks), and requeued the job, which completed. Status said `failed first: rank 0 on node1: Killed (said by srun)`
    and `node failed: one of node1, node2`: the healthy node."""
    rec = record(tmp_path)
    run = first_start(rec, 60)
    append_jsonl(run.restarts, {"time": FAILED_EPOCH + 20, "restart": 1, "job_id": "42", "world_size": 4})
    run.write_final(FinalState.FINISHED, "reached step 400", job_id="42")
    out = tmp_path / "slurm-42.out"
    out.write_text("srun: error: node1: task 0: Killed\nsrun: error: node1: task 1: Killed\n")
    rec = JobRecord(**{**rec.__dict__, "logs": {"slurm": str(out)}})
    slurm = Slurm(squeue=(0, f"COMPLETED|{job_comment(rec.run_dir)}\n"),
                  scontrol_show_job=(0, job_line(rec, "COMPLETED", "None", 1, end="2026-11-25T10:20:00")),
                  sacct=(0, f"NODE_FAIL|node[1-2]|{FAILED_AT}\nCOMPLETED|node[1-2]|2026-11-25T10:20:00\n"),
                  scontrol_show_node=(0, f"{NODE1}\n{NODE2_BACK}\n"))
    st = status_of(rec, SlurmBackend(slurm))
    assert st.state == JobState.COMPLETED and st.restarts == 1
    assert st.first_failure is not None and st.first_failure.startswith("node node2 failed: its reason is gone"), \
        st.first_failure
    assert "ranks 2, 3 on it recorded nothing" in st.first_failure
    assert st.node_faults == ("node2: its reason is gone: the node is up again (sacct: the job's allocation ended "
                              "NODE_FAIL; Slurm requeued the job)",)
    present.status(st, None)
    said = capsys.readouterr().out
    assert "node1: Killed" not in said and "one of node1" not in said, said


def test_a_job_ended_by_the_restart_cap_shows_why_not_a_rank_that_wrote_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 38 "Words": status said `failed first: rank 0 on node1: Exited with exit code 1 (said by srun; the rank
    wrote nothing)` for a job the restart cap ended, though rank 0 wrote the cap's line and final.json."""
    rec = record(tmp_path)
    run = first_start(rec, 40)
    append_jsonl(run.restarts, {"time": FAILED_EPOCH - 10, "restart": 0, "stopped": "timeout", "step": 40})
    reason = ("restart cap 2 reached (timeout): 2 requeues in a row brought no checkpoint newer than step 40; "
              "stopped each time by: timeout")
    run.write_final(FinalState.FAILED, reason, 40, job_id="42")
    out = tmp_path / "slurm-42.out"
    out.write_text("srun: error: node1: task 0: Exited with exit code 1\n")
    rec = JobRecord(**{**rec.__dict__, "logs": {"slurm": str(out)}})
    slurm = Slurm(squeue=(0, f"FAILED|{job_comment(rec.run_dir)}\n"), sacct=(0, f"FAILED|node[1-2]|{FAILED_AT}\n"),
                  scontrol_show_job=(0, job_line(rec, "FAILED", "NonZeroExitCode", 2, end=FAILED_AT)))
    st = status_of(rec, SlurmBackend(slurm))
    assert st.state == JobState.FAILED and st.first_failure is None, st
    present.status(st, None)
    shown = capsys.readouterr().out
    assert reason in shown and "wrote nothing" not in shown, shown
    killed = tmp_path / "slurm-43.out"  # a rank killed by a signal is still the first failure
    killed.write_text("srun: error: node2: task 3: Killed\n")
    st = status_of(JobRecord(**{**rec.__dict__, "logs": {"slurm": str(killed)}}), SlurmBackend(slurm))
    assert st.first_failure is not None and "rank 3 on node2: Killed" in st.first_failure, st.first_failure
