"""Which rank failed first (hpcjobs.protocol.faultpolicy.diagnosis) from the ranks' own records, srun's lines and the
silent ranks; the real-cluster versions of these faults are in tests/cluster/test_faults_cluster.py."""

from __future__ import annotations

from pathlib import Path

from hpcjobs.protocol.faultpolicy.diagnosis import NodeFault, diagnose
from hpcjobs.protocol.faultpolicy.kinds import DID_NOT_RUN
from hpcjobs.protocol.faultpolicy.srunwords import srun_failures, task_ids
from hpcjobs.protocol.runfolder import RunFolder, append_jsonl


def run_with(tmp_path: Path, failures: list[tuple[float, int, str]], world: int = 4) -> RunFolder:
    run = RunFolder(tmp_path / "run")
    run.record_start(0, "7", world)
    for rank in range(world):
        run.rank_log(0, rank).parent.mkdir(parents=True, exist_ok=True)
        run.rank_log(0, rank).write_text(f"hpcjobs: rank {rank}/{world} (local {rank % 2}) on node{1 + rank // 2}, "
                                         f"job 7 restart 0, ...\nstep 10 | loss 1.0\nlast words of rank {rank}\n")
    for when, rank, error in failures:
        append_jsonl(run.failures, {"time": when, "job_id": "7", "restart": 0, "rank": rank,
                                    "host": f"node{1 + rank // 2}", "error": error, "log": str(run.rank_log(0, rank))})
    return run


def test_srun_task_lists_and_lines() -> None:
    assert task_ids("3") == [3] and task_ids("0-1") == [0, 1] and task_ids("0,2-3") == [0, 2, 3]
    text = ("noise\nsrun: error: node2: task 3: Killed\nsrun: Terminating StepId=7.0\n"
            "srun: error: node1: tasks 0-1: Exited with exit code 1\n")
    assert [(f.rank, f.host, f.error) for f in srun_failures(text)] == [
        (3, "node2", "Killed"), (0, "node1", "Exited with exit code 1"), (1, "node1", "Exited with exit code 1")]


def test_an_exception_is_the_first_failure_not_the_peers_that_lost_it(tmp_path: Path) -> None:
    run = run_with(tmp_path, [(2.0, 0, "RuntimeError: Connection closed by peer"),
                              (1.0, 3, "InjectedFault: injected at step@5")])
    found = diagnose(run, "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe() == "rank 3 on node2: InjectedFault: injected at step@5"
    assert found.tail[-1] == "last words of rank 3"


def test_a_killed_rank_named_by_srun_comes_before_the_record_of_the_rank_that_lost_it(tmp_path: Path) -> None:
    run = run_with(tmp_path, [(1.0, 0, "DistBackendError: Connection closed by peer")])
    said = srun_failures("srun: error: node1: task 0: Exited with exit code 1\nsrun: error: node2: task 3: Killed\n")
    found = diagnose(run, "7", said)
    assert found is not None and found.first is not None
    assert found.first.describe() == "rank 3 on node2: Killed (said by srun; the rank wrote nothing)"
    assert found.first.log == str(run.rank_log(0, 3)) and found.tail[-1] == "last words of rank 3"


def test_when_the_others_timed_out_the_silent_rank_is_the_hung_one(tmp_path: Path) -> None:
    timeouts = [(1.0 + r, r, "DistBackendError: [Gloo] Timed out waiting 20000ms for recv") for r in (0, 1, 2)]
    found = diagnose(run_with(tmp_path, timeouts), "7", [])
    assert found is not None and found.first is not None and found.silent == (3,)
    assert found.first.describe().startswith("rank 3 on node2: hung: the other ranks timed out waiting for it")
    # srun kills the stuck rank once the others exited: it still hung first
    said = srun_failures("srun: error: node1: tasks 0-1: Exited with exit code 1\nsrun: error: node2: task 3: Killed\n")
    found = diagnose(run_with(tmp_path / "b", timeouts), "7", said)
    assert found is not None and found.first is not None and found.silent == ()
    assert found.first.describe().startswith("rank 3 on node2: hung: the other ranks timed out waiting for it")
    woken = [*timeouts, (9.0, 3, "RuntimeError: Connection closed by peer")]  # SIGCONT + SIGTERM from Slurm
    found = diagnose(run_with(tmp_path / "c", woken), "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe().startswith("rank 3 on node2: hung: the other ranks timed out waiting for it")
    # Rank 0 lost its peer (which closed its sockets while unwinding) before that peer recorded its timeout.
    early = [(0.5, 0, "RuntimeError: Connection closed by peer"), *timeouts[1:],
             (9.0, 3, "RuntimeError: Connection closed by peer")]
    found = diagnose(run_with(tmp_path / "d", early), "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe().startswith("rank 3 on node2: hung: the other ranks timed out waiting for it")


def test_nothing_failed_or_another_job_failed(tmp_path: Path) -> None:
    assert diagnose(run_with(tmp_path, []), "7", []) is None
    assert diagnose(run_with(tmp_path / "b", [(1.0, 1, "ValueError: x")]), "8", []) is None


def test_a_ranks_own_exception_comes_before_the_kills_srun_did_after_it(tmp_path: Path) -> None:
    # The CI failure: rank 3 raised; srun killed the step's other tasks and its line about rank 0 came first.
    run = run_with(tmp_path, [(1.0, 3, "InjectedFault: injected at step@20")])
    said = srun_failures("srun: error: node1: task 0: Killed\nsrun: error: node2: task 3: Exited with exit code 1\n")
    found = diagnose(run, "7", said)
    assert found is not None and found.first is not None
    assert found.first.describe() == "rank 3 on node2: InjectedFault: injected at step@20"


# --- hang watchdogs' records (trainers/watchdog.py: `hung: ...` on every rank whose step progress stopped) -------

HUNG_WAITING = "hung: no step progress for 45 s (step 285; bound 45 s from 0.4 s steps)"


def test_the_rank_whose_watchdog_never_recorded_is_the_hung_one(tmp_path: Path) -> None:
    """Rank 3 SIGSTOPped: the healthy ranks' watchdogs fire together; the hung one records nothing (killed)."""
    waits = [(10.0 + 0.1 * r, r, HUNG_WAITING) for r in (0, 1, 2)]
    found = diagnose(run_with(tmp_path, waits), "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe().startswith("rank 3 on node2: hung: the other ranks stopped (their hang watchdogs "
                                             "fired) waiting for it"), found.first.describe()
    said = srun_failures("srun: error: node1: tasks 0-2: Exited with exit code 124\n"
                         "srun: error: node2: task 3: Killed\n")
    found = diagnose(run_with(tmp_path / "b", waits), "7", said)
    assert found is not None and found.first is not None and found.first.rank == 3


def test_the_rank_whose_watchdog_recorded_last_after_the_others_is_the_hung_one(tmp_path: Path) -> None:
    """Slurm's SIGCONT, when it ends the step, wakes the SIGSTOPped rank 3: its watchdog records last, seconds after
    the others' (which came within a second of each other). Rank 0's record came first: the old diagnosis named it."""
    waits = [(10.0, 0, HUNG_WAITING), (10.3, 1, HUNG_WAITING), (10.6, 2, HUNG_WAITING),
             (16.0, 3, "hung: no step progress for 51 s (step 285)")]
    found = diagnose(run_with(tmp_path, waits), "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe().startswith("rank 3 on node2: hung: no step progress for 51 s"), found.first
    assert "came last" in found.first.describe() and found.tail[-1] == "last words of rank 3"
    # Woken, it failed on the closed connections instead of recording its hang: still the hung one.
    woken = [*waits[:3], (16.0, 3, "RuntimeError: Connection closed by peer")]
    found = diagnose(run_with(tmp_path / "b", woken), "7", [])
    assert found is not None and found.first is not None and found.first.rank == 3


def test_hang_records_close_together_name_no_rank_as_hung(tmp_path: Path) -> None:
    """Every rank stalled at once (a filesystem, say): no rank is the one the others waited for."""
    waits = [(10.0 + 0.2 * r, r, HUNG_WAITING) for r in range(4)]
    found = diagnose(run_with(tmp_path, waits), "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe() == f"rank 0 on node1: {HUNG_WAITING}"
    one = diagnose(run_with(tmp_path / "b", [(1.0, 0, HUNG_WAITING)], world=1), "7", [])
    assert one is not None and one.first is not None and one.first.describe() == f"rank 0 on node1: {HUNG_WAITING}"


def test_the_rank_whose_own_process_did_not_run_is_the_hung_one_not_the_first_to_record(tmp_path: Path) -> None:
    """Issue 40: a SIGSTOPped rank 3, woken by Slurm's SIGCONT, records its hang seconds after its peers fired, and
    its watchdog says its own process did not run (trainers/watchdog.py): it is named, even where the peers'
    records are spread out (a loaded node) and it recorded before one of them."""
    stopped = f"hung: no step progress for 19 s after step 29 ({DID_NOT_RUN} for 18 s: stopped by a signal, ...)"
    waits = [(10.0, 0, HUNG_WAITING), (10.4, 3, stopped), (13.0, 1, HUNG_WAITING), (14.0, 2, HUNG_WAITING)]
    found = diagnose(run_with(tmp_path, waits), "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe() == f"rank 3 on node2: {stopped}; the other ranks waited for it", found.first
    every = [(10.0 + 0.2 * r, r, stopped) for r in range(4)]  # the whole job suspended: no one in particular
    found = diagnose(run_with(tmp_path / "b", every), "7", [])
    assert found is not None and found.first is not None and found.first.rank == 0


def test_a_rank_that_timed_out_only_once_woken_is_the_hung_one_not_rank_0(tmp_path: Path) -> None:
    """Measured on the test cluster (1 hang run of 4, 120 s collective timeout): ranks 0-2 timed out waiting for the
    SIGSTOPped rank 3, which recorded a timeout too once Slurm woke it; rank 0, the first record, was named."""
    timeout = "DistBackendError: [Gloo] Timed out waiting 120000ms for recv operation to complete"
    waits = [(120.0, 0, timeout), (120.1, 1, timeout), (120.3, 2, timeout), (126.0, 3, timeout)]
    found = diagnose(run_with(tmp_path, waits), "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe().startswith(f"rank 3 on node2: {timeout} (its record came last"), found.first


# --- a node that failed (the scheduler's word, hpcjobs.backends.slurm.failed_nodes)
# ------------------------------------

def test_a_failed_node_comes_before_the_healthy_peers_connection_reset(tmp_path: Path) -> None:
    """Measured: node2 killed with its link up; ranks 0 and 1 on node1 recorded `Connection reset by peer`, ranks 2
    and 3 nothing, and Slurm said NODE_FAIL. The old diagnosis named rank 1 on node1."""
    reset = [(5.0, 1, "DistBackendError: [Gloo] ... Connection reset by peer"),
             (5.1, 0, "DistBackendError: [Gloo] ... Connection reset by peer")]
    fault = NodeFault(("node1", "node2"), "Not responding [slurm@2026-11-25T10:04:12]",
                      "sacct: the allocation ended NODE_FAIL", time=0.0, requeued=True)
    found = diagnose(run_with(tmp_path, reset), "7", [], [fault])
    assert found is not None and found.first is not None
    text = found.first.describe()
    assert text == ("node node2 failed: Not responding [slurm@2026-11-25T10:04:12] (sacct: the allocation ended "
                    "NODE_FAIL; Slurm requeued the job); ranks 2, 3 on it recorded nothing"), text
    assert "reset" not in text and found.first.log == str(run_with(tmp_path, []).rank_log(0, 2))
    # Nothing recorded at all (the rank 0 node died): the node still answers.
    found = diagnose(run_with(tmp_path / "b", []), "7", [], [NodeFault(("node1",), "Not responding", "job NODE_FAIL")])
    assert found is not None and found.first is not None
    assert found.first.describe().startswith("node node1 failed: Not responding (job NODE_FAIL); ranks 0, 1 on it")


def test_a_node_that_failed_before_the_last_start_is_an_earlier_starts(tmp_path: Path) -> None:
    run = run_with(tmp_path, [(5.0, 1, "ValueError: x")])
    start = run.read_restarts()[-1]["time"]
    earlier = NodeFault(("node2",), "Not responding", "sacct: the allocation ended NODE_FAIL", time=start - 60)
    found = diagnose(run, "7", [], [earlier])
    assert found is not None and found.first is not None and found.first.describe() == "rank 1 on node1: ValueError: x"
    # nothing failed in the last start: the node that ended the earlier one, diagnosed against that start
    alone = diagnose(run_with(tmp_path / "b", []), "7", [], [earlier])
    assert alone is not None and alone.first is not None and alone.first.describe().startswith(
        "node node2 failed: Not responding (sacct: the allocation ended NODE_FAIL)"), alone
