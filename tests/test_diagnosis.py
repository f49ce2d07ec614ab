"""Which rank failed first (hpcjobs.protocol.diagnosis) from the ranks' own records, srun's lines and the silent
ranks; the real-cluster versions of these faults are in tests/cluster/test_faults_cluster.py."""

from __future__ import annotations

from pathlib import Path

from hpcjobs.protocol.diagnosis import diagnose
from hpcjobs.protocol.runfolder import RunFolder, append_jsonl
from hpcjobs.protocol.srunwords import srun_failures, task_ids


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
                              (1.0, 3, "InjectedFault: injected at step of step 5")])
    found = diagnose(run, "7", [])
    assert found is not None and found.first is not None
    assert found.first.describe() == "rank 3 on node2: InjectedFault: injected at step of step 5"
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
    run = run_with(tmp_path, [(1.0, 3, "InjectedFault: injected at step of step 20")])
    said = srun_failures("srun: error: node1: task 0: Killed\nsrun: error: node2: task 3: Exited with exit code 1\n")
    found = diagnose(run, "7", said)
    assert found is not None and found.first is not None
    assert found.first.describe() == "rank 3 on node2: InjectedFault: injected at step of step 20"
