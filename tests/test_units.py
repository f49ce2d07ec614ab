"""Small pure parts: checkpoint folders, the job store under concurrency, the stop flag, config, Slurm notation.
(The node side's launch contract, Slurm control calls and trainer flags: tests/test_contract_node.py.)"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.profiles.slurmtime import format_time, parse_mem_mb, parse_time
from hpcjobs.protocol.contract import LaunchContract, Preemption
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.folderlock import read_holder
from hpcjobs.protocol.ports import free_port
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args
from hpcjobs.protocol.states import StopReason
from trainers import checkpoint, preemption
from trainers.agreement import Agreement


def save(root: Path, step: int, keep: int = 2) -> Path:
    return checkpoint.save_checkpoint(root, step, {"w": torch.full((3,), float(step))}, {"r": torch.tensor(step)},
                                      keep=keep)


def test_checkpoint_layout_and_retention(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        save(tmp_path, step)
    assert [r.step for r in checkpoint.finished(tmp_path)] == [20, 30]
    final = tmp_path / "step-30"
    assert sorted(p.name for p in final.iterdir()) == ["FINISHED", "meta.json", "rank-0.pt", "shared.pt"]
    shared, mine = checkpoint.load_checkpoint(checkpoint.latest(tmp_path), 0)
    assert torch.equal(shared["w"], torch.full((3,), 30.0)) and int(mine["r"]) == 30


def test_unfinished_folders_are_ignored_and_cleared(tmp_path: Path) -> None:
    save(tmp_path, 10)
    (tmp_path / ".step-20.tmp").mkdir()  # a save killed before it committed
    (tmp_path / "step-30").mkdir()       # a folder without the FINISHED marker
    assert checkpoint.latest(tmp_path).step == 10
    save(tmp_path, 20)
    assert not (tmp_path / ".step-20.tmp").exists() and checkpoint.latest(tmp_path).step == 20


def test_the_best_checkpoint_outlives_retention(tmp_path: Path) -> None:
    save(tmp_path, 10)
    checkpoint.mark_best(tmp_path, 10, "val_loss", 0.5)
    for step in (20, 30, 40):
        save(tmp_path, step)
    assert [r.step for r in checkpoint.finished(tmp_path)] == [10, 30, 40]
    checkpoint.mark_best(tmp_path, 40, "val_loss", 0.4)
    save(tmp_path, 50)
    assert [r.step for r in checkpoint.finished(tmp_path)] == [40, 50]
    assert checkpoint.read_best(tmp_path) == {"step": 40, "metric": "val_loss", "value": 0.4}
    assert not list(tmp_path.glob(".*.tmp"))


def test_keep_best_needs_evaluations() -> None:
    with pytest.raises(ConfigError, match="--keep-best without --eval-every.*HINT"):
        parse_trainer_args(["--keep-best"])
    assert parse_trainer_args(["--keep-best", "--eval-every", "5"])[0].eval_every == 5


def test_keep_must_leave_a_spare(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        save(tmp_path, 1, keep=1)


class Boom:
    def __reduce__(self):  # a pickle that would run code when loaded
        return (os.system, ("echo pwned",))


def test_loading_never_runs_pickled_code(tmp_path: Path) -> None:
    ref_dir = save(tmp_path, 5)
    with open(ref_dir / "shared.pt", "wb") as f:
        torch.save({"evil": Boom()}, f)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load_checkpoint(checkpoint.latest(tmp_path), 0)


def _add_many(path: str, who: int) -> None:
    store = JobStore(Path(path))
    for i in range(25):
        store.add(JobRecord(f"{who}-{i}", "n", "p", "slurm", 1, 1, "/r", {}, {}, time.time()))


def test_store_loses_nothing_under_concurrent_writers(tmp_path: Path) -> None:
    path = str(tmp_path / "jobs.sqlite")
    procs = [multiprocessing.Process(target=_add_many, args=(path, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert len(JobStore(Path(path)).recent(1000)) == 100


def test_store_newest_record_wins_for_a_reused_id(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "s.sqlite")
    store.add(JobRecord("7", "old", "p", "slurm", 1, 1, "/a", {}, {}, 1.0))
    store.add(JobRecord("7", "new", "p", "slurm", 1, 1, "/b", {}, {}, 2.0))
    assert store.get("7").name == "new" and store.get("8") is None


def _restore_handlers(*nums: int) -> None:
    for s in nums:
        signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)


def test_the_handler_only_sets_a_flag() -> None:
    usr1 = LaunchContract(run_dir="r", preemption=Preemption(signal="USR1"))
    preemption.reset()
    preemption.install(usr1, {})
    try:
        assert preemption.stop_reason(usr1, {"SLURM_JOB_ID": "1"}) is None  # nobody asked
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested_locally()
        assert preemption.first_request()[0] == "SIGUSR1"
        assert preemption.stop_reason(usr1, {"SLURM_JOB_ID": "1"}) == StopReason.PREEMPTION
        assert preemption.stop_reason(usr1, {}) == StopReason.INTERRUPT
        now = time.time()
        env = {"SLURM_JOB_ID": "1", "SLURM_JOB_END_TIME": str(int(now) + 60)}
        assert preemption.stop_reason(usr1, env, now) == StopReason.TIMEOUT
        # Slurm 22.05 has no SLURM_JOB_END_TIME: the launcher's start time plus the limit.
        started = replace(usr1, preemption=Preemption(signal="USR1", seconds_before=60), time_limit_s=120,
                          start_time=now - 40)
        assert preemption.stop_reason(started, {"SLURM_JOB_ID": "1"}, now) == StopReason.TIMEOUT
        assert preemption.stop_reason(replace(started, time_limit_s=3600), {"SLURM_JOB_ID": "1"},
                                      now) == StopReason.PREEMPTION
        preemption.reset()
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.stop_reason(usr1, {"SLURM_JOB_ID": "1"}) == StopReason.TERMINATED
        assert str(preemption.stop_reason(usr1, {"SLURM_JOB_ID": "1"})) == "terminated"  # as restarts.jsonl holds it
    finally:
        preemption.reset()
        _restore_handlers(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def test_a_stray_signal_under_slurm_is_neither_an_interrupt_nor_a_preemption(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured on the test cluster: a SIGINT to a rank after its node came back was recorded as `interrupt`, the
    word of a local Ctrl-C. Under Slurm a signal that is not the profile's is `signal`; a local Ctrl-C stays
    `interrupt`. Fails on the old code: PREEMPTION from the trainer's handler, INTERRUPT from a script's own
    KeyboardInterrupt (trainers.launch.interrupted)."""
    from hpcjobs.protocol.runfolder import RunFolder
    from trainers import launch
    from trainers.distenv import DistEnv

    usr1 = LaunchContract(run_dir=str(tmp_path), preemption=Preemption(signal="USR1"))
    preemption.reset()
    preemption.install(usr1, {})
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.stop_reason(usr1, {"SLURM_JOB_ID": "1"}) == StopReason.SIGNAL == "signal"
        assert preemption.stop_reason(usr1, {}) == StopReason.INTERRUPT
    finally:
        preemption.reset()
        _restore_handlers(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
    assert preemption.stop_reason(usr1, {"SLURM_JOB_ID": "1"}, unasked=True) == StopReason.SIGNAL
    assert preemption.stop_reason(usr1, {}, unasked=True) == StopReason.INTERRUPT
    assert preemption.stop_reason(usr1, {"SLURM_JOB_ID": "1"}) is None
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    run = RunFolder(tmp_path)
    rank0 = DistEnv(0, 0, 1, 1, "localhost", 29500, "42", 0, "slurm")
    quiet = SimpleNamespace(log_only=lambda text: None)
    for env, word in (({"SLURM_JOB_ID": "42"}, "signal"), ({}, "interrupt")):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert launch.interrupted(rank0, run, quiet, usr1) == launch.INTERRUPTED_EXIT  # type: ignore[arg-type]
        assert run.read_restarts()[-1]["stopped"] == word


def test_a_rank_stops_by_itself_when_the_time_limit_signal_never_came() -> None:
    now = time.time()
    job = {"SLURM_JOB_ID": "1"}
    contract = LaunchContract(run_dir="r", preemption=Preemption(seconds_before=60), time_limit_s=90)
    preemption.reset()
    try:
        preemption.install(replace(contract, start_time=now), job)  # signal due at now + 30
        asked: list[list[str]] = []

        def scontrol(end: float) -> Callable[..., object]:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end))
            return lambda argv, **kw: asked.append(argv) or SimpleNamespace(
                stdout=f"JobId=1 JobState=RUNNING TimeLimit=00:01:30 EndTime={stamp} Partition=low\n")

        assert not preemption.requested_locally(now + 29, scontrol(now + 90)) and not asked
        # Overdue: Slurm is asked once; the limit was extended by an hour, so the rank trains on.
        assert not preemption.requested_locally(now + 31, scontrol(now + 3690))
        assert asked == [["scontrol", "show", "job", "-o", "1"]]
        assert not preemption.requested_locally(now + 60, scontrol(now + 3690)) and len(asked) == 1
        assert preemption.requested_locally(now + 3631, scontrol(now + 3690))  # the new due time, no extension
        assert preemption.first_request()[0] == "deadline"
        preemption.reset()
        preemption.install(replace(contract, start_time=now), job)
        assert preemption.requested_locally(now + 31, lambda argv, **kw: SimpleNamespace(stdout=""))  # no answer
        assert preemption.stop_reason(replace(contract, start_time=now), job) == StopReason.TIMEOUT
        preemption.reset()
        preemption.install(replace(contract, start_time=now - 300), job)
        os.kill(os.getpid(), preemption.signal_number(contract.preemption.signal))  # the profile's (the default)
        assert preemption.requested_locally() and preemption.first_request()[0] == f"SIG{contract.preemption.signal}"
        for env in (job, {}):  # no time limit in the contract (a local run given no --time): never by themselves
            preemption.reset()
            preemption.install(replace(contract, time_limit_s=0, start_time=now - 10**6), env)
            assert not preemption.requested_locally()
        preemption.reset()  # a local run's --time is enforced as Slurm's is: the rank stops at its own deadline too
        preemption.install(replace(contract, start_time=now - 10**6), {})
        assert preemption.requested_locally() and preemption.first_request()[0] == "deadline"
    finally:
        preemption.reset()
        _restore_handlers(signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


def test_a_rank_whose_start_outlasted_the_deadline_still_joins_its_rank_0(tmp_path: Path) -> None:
    """The time limit is already overdue when a slow rank 1 reaches the launcher (its start took longer than the
    time left): it must wait for its rank 0 and stop with the others at their first check. Counted as a stop, it
    left quietly while rank 0 went on and waited for it until Slurm killed the job (FAILED, seen on the cluster)."""
    from hpcjobs.protocol.runfolder import RunFolder
    from trainers import runlock
    from trainers.distenv import DistEnv
    from trainers.launch import claim_run_folder

    contract = LaunchContract(run_dir=str(tmp_path), preemption=Preemption(seconds_before=60), time_limit_s=90)
    job = {"SLURM_JOB_ID": "5"}
    env = [DistEnv(rank, rank, 2, 2, "127.0.0.1", 1, "5", 0, "slurm") for rank in (0, 1)]
    run = RunFolder(str(tmp_path))
    preemption.reset()
    try:
        preemption.install(replace(contract, start_time=time.time() - 120), job)  # due 90 s ago
        assert not preemption.signalled()
        later = threading.Timer(0.5, lambda: held.append(runlock.take(run, env[0])))
        held: list[runlock.RunLock] = []
        later.start()
        assert claim_run_folder(run, env[1]) is None and runlock.same_start(read_holder(run), env[1])
        later.join()
        os.kill(os.getpid(), signal.SIGUSR2)  # a real stop signal counts where the overdue deadline did not
        assert preemption.signalled()
    finally:
        preemption.reset()
        _restore_handlers(signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


EXITING_RANK = """import sys, time
from hpcjobs.protocol.contract import LaunchContract, Preemption
from trainers import preemption
usr1 = LaunchContract(run_dir="r", preemption=Preemption(signal="USR1"))
preemption.install(usr1, {})
class Slow:  # stands for torch's teardown while the interpreter shuts down
    def __del__(self):
        time.sleep(3)
slow = Slow()
if sys.argv[1] == "ignore":
    preemption.ignore_from_now(usr1)
print("done", flush=True)
"""


@pytest.mark.train
@pytest.mark.parametrize("ignored", [True, False])
def test_a_signal_while_a_finished_rank_shuts_down_does_not_kill_it(ignored: bool) -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", EXITING_RANK, "ignore" if ignored else "keep"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "done"
    time.sleep(1.0)  # the interpreter is shutting down (in Slow.__del__, 3 s)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == (0 if ignored else -signal.SIGUSR1)


def _agree(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    agreement = Agreement()
    answers = [agreement.any_rank_pipelined(rank == 1 and call >= 3) for call in range(6)]
    answers.append(agreement.close())
    answers.append(agreement.any_rank(rank == 0))
    Path(out, f"rank-{rank}.txt").write_text(repr(answers))
    dist.destroy_process_group()


@pytest.mark.train
def test_ranks_agree_on_a_stop_at_the_same_call(tmp_path: Path) -> None:
    """Rank 1 alone is asked to stop at call 3: the pipelined check tells both ranks at call 4, not before."""
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_agree, args=(r, port, str(tmp_path))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    expected = [False, False, False, False, True, True, True, True]
    assert [eval((tmp_path / f"rank-{r}.txt").read_text()) for r in range(2)] == [expected, expected]


def test_config_batches_and_lr_scaling() -> None:
    cfg = TrainConfig(global_batch_size=64, grad_accum=2, lr=1e-3, lr_scaling="sqrt")
    assert cfg.per_rank_batch(8) == 8 and cfg.micro_batch(8) == 4 and cfg.lr_factor(16) == 4.0
    assert TrainConfig(lr_scaling="linear").lr_factor(16) == 16.0 and TrainConfig().lr_factor(16) == 1.0
    with pytest.raises(ValueError, match="does not divide by the world size"):
        TrainConfig(global_batch_size=10).per_rank_batch(4)
    with pytest.raises(ValueError, match="grad_accum"):
        TrainConfig(batch_size=6, grad_accum=4).micro_batch(1)


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("1:30", 90), ("4:00:00", 14400), ("1-00", 86400),
                                          ("2-03:04", 183840), ("1-00:00:05", 86405)])
def test_slurm_times(text: str, seconds: int) -> None:
    assert parse_time(text) == seconds and parse_time(format_time(seconds)) == seconds


@pytest.mark.parametrize("bad", ["", "abc", "1:2:3:4", "0", "-5", "1-"])
def test_bad_slurm_times(bad: str) -> None:
    with pytest.raises(UsageError):
        parse_time(bad)


def test_memory() -> None:
    assert parse_mem_mb("64G") == 65536 and parse_mem_mb("500M") == 500 and parse_mem_mb(2048) == 2048
    with pytest.raises(UsageError):
        parse_mem_mb("0G")


@pytest.mark.parametrize("source,names", [
    ("def make_task(args): ...\nclass T: ...\nx, (y, z) = 1, (2, 3)\nimport a.b as c, d.e\n",
     {"make_task", "T", "x", "y", "z", "c", "d"}),
    ("from m import *\n", None),  # anything: only running it tells
    ("try:\n    from fast import task\nexcept ImportError:\n    task = None\n", None),
    ("def __getattr__(name): ...\n", None),  # a module __getattr__ answers any name
    ("def broken(:\n", None),
])
def test_a_task_modules_names_are_read_without_running_it(source: str, names: set[str] | None) -> None:
    from hpcjobs.request.entry import _top_level_names

    assert _top_level_names(source) == names
