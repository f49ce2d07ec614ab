"""The hang watchdog (issue 27 item 3, trainers/watchdog.py): its bound, its text, and in child processes its dump:
a main thread asleep for ever, a rank SIGSTOPped past its bound and woken by SIGCONT, leave every thread's stack
in RUN/stacks/restart-N/rank-R.txt, one `hung:` failure record with the step, and exit code 124. No timing
assertions: only what happened, with generous waits."""

from __future__ import annotations

import faulthandler
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, hpcjobs
from hpcjobs.protocol.contract import LaunchContract, Recovery
from hpcjobs.protocol.faultpolicy.kinds import DID_NOT_RUN, HANG_EXIT, HUNG, FaultKind, kind_of
from hpcjobs.protocol.runfolder import RunFolder, append_jsonl
from trainers import watchdog
from trainers.distenv import CONTROL_TIMEOUT_MIN_S, DistEnv
from trainers.hangbound import SAVE_K, STEPS_MEASURED, Bound, K, save_allowance, startup_bound, step_bound
from trainers.hangreport import LATE_NOTE
from trainers.watchdog import Watchdog

ENV = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=1,
              job_id="7", restart=3, source="single")


def test_the_bound_is_the_start_up_one_until_steps_are_measured_then_k_median_step_times_over_the_floor() -> None:
    start = startup_bound(300, {})
    assert start.seconds == 300 and "HPCJOBS_INIT_TIMEOUT" in start.how
    assert startup_bound(300, {"HPCJOBS_INIT_TIMEOUT": "900"}).seconds == 900
    assert startup_bound(600, {}).how == "start-up bound, recovery.hang_min_s"
    assert step_bound(5, [2.0] * (STEPS_MEASURED - 1), start) == start  # compile, warm-up: not yet measured
    # One slow step (a log step's sync, a save) does not move the median.
    assert step_bound(5, [2.0, 2.0, 30.0, 2.0], start) == Bound(K * 2.0, f"{K} × 2 s step time")
    assert step_bound(5, [0.01] * 10, start).seconds == 5  # fast steps: the floor
    assert step_bound(5, [1.0] * 40 + [3.0] * 32, start).seconds == K * 3.0  # the recent window only


def test_a_save_in_flight_is_allowed_from_the_measured_save_cost() -> None:
    assert save_allowance(5, []).seconds == CONTROL_TIMEOUT_MIN_S  # none measured: the checkpoint barrier's wait
    assert save_allowance(5, [1.0, 10.0, 2.0]) == Bound(SAVE_K * 10.0, f"{SAVE_K} × 10 s longest save")
    assert save_allowance(300, [1.0]).seconds == 300


def make(tmp_path: Path, floor: float = 5) -> Watchdog:
    return Watchdog(RunFolder(tmp_path / "run"), ENV, floor, Bound(300, "start-up bound, HPCJOBS_INIT_TIMEOUT"))


def test_its_text_names_the_last_step_the_wait_and_the_bound_with_how_it_was_derived(tmp_path: Path) -> None:
    dog = make(tmp_path)
    t = dog.base
    assert dog.overdue(t + 299) is None
    assert dog.overdue(t + 310) == ("hung: no step progress for 310 s since the start (bound 300 s = start-up "
                                    "bound, HPCJOBS_INIT_TIMEOUT)")
    for step in range(1, 6):
        dog.progress(step)
    dog.step_times.clear()
    dog.step_times.extend([2.0] * 5)
    dog.step, dog.base = 57, t
    assert dog.overdue(t + 39) is None
    text = dog.overdue(t + 41)
    assert text == "hung: no step progress for 41 s after step 57 (bound 40 s = 20 × 2 s step time)"
    assert text.startswith(HUNG) and kind_of(text) == FaultKind.INFRASTRUCTURE


class Thread:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


def test_a_save_extends_the_bound_and_a_save_stuck_past_its_allowance_is_a_hang(tmp_path: Path) -> None:
    dog = make(tmp_path)
    dog.save_costs = [3.0]  # allowance: 4 × 3 = 12 s
    dog.step_times.extend([2.0] * 5)  # bound 40 s
    dog.step = 10
    dog.saving(10)
    t = dog.save.began  # type: ignore[union-attr]
    dog.base = t
    assert dog.overdue(t + 11) is None  # foreground save, within both
    assert "save of step 10 still in flight after 13 s (allowance 12 s = 4 × 3 s longest save)" in \
        str(dog.overdue(t + 13))
    writer = Thread(alive=True)
    dog.saved(until=writer)  # a background save: the loop goes on, the save is still bounded
    assert dog.save is not None and dog.save.until is writer
    dog.progress(11)
    assert dog.save is not None  # a step does not end a background save
    assert "the checkpoint save of step 10 still in flight" in str(dog.overdue(t + 13))
    writer.alive = False
    assert dog.overdue(t + 13) is None and dog.save is None and len(dog.save_costs) == 2  # it ended: measured


CHILD = """
import sys, time
from pathlib import Path
from hpcjobs.protocol.runfolder import RunFolder
from trainers.distenv import DistEnv
from trainers.watchdog import Bound, Watchdog

env = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=1,
              job_id="7", restart=3, source="single")
dog = Watchdog(RunFolder(sys.argv[1]), env, 1.0, Bound(1.0, "start-up bound, test")).start()
for step in range(1, 8):
    dog.progress(step)
    time.sleep(0.01)
print("ready", flush=True)

def waits_for_ever():
    time.sleep(100000)

waits_for_ever()
"""


def child(tmp_path: Path) -> tuple[subprocess.Popen[str], RunFolder]:
    run = RunFolder(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), str(run.path)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc, run


def check_left(run: RunFolder, proc: subprocess.Popen[str]) -> str:
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == HANG_EXIT, err
    stacks = run.stack_file(3, 1).read_text()
    assert "waits_for_ever" in stacks, stacks
    assert stacks.count("hung: no step progress") == 1 and stacks.count("most recent call first") >= 2, stacks
    (record,) = run.read_failures()
    assert record["error"].startswith("hung: no step progress for ") and "after step 7 (bound 1 s" in record["error"]
    assert (record["rank"], record["restart"], record["step"]) == (1, 3, 7)
    assert record["idle_s"] >= 1.0  # since its last progress: goodput's time to notice the hang (issue 40)
    assert json.loads(run.final.read_text())["reason"].startswith("rank 1 on ")
    assert f"every thread's stack in {run.stack_file(3, 1)}" in err
    return stacks


def test_a_rank_whose_main_thread_waits_for_ever_leaves_its_stacks_and_exits_124(tmp_path: Path) -> None:
    proc, run = child(tmp_path)
    check_left(run, proc)


@pytest.mark.train
def test_a_rank_stopped_past_its_bound_dumps_once_it_is_continued(tmp_path: Path) -> None:
    proc, run = child(tmp_path)
    proc.send_signal(signal.SIGSTOP)
    stack_file = run.stack_file(3, 1)
    time.sleep(8)  # past the bound (1 s) and past the C timer's (at most 1 + 4 × its 2 s slack)
    assert stack_file.stat().st_size == 0  # stopped: nothing ran
    proc.send_signal(signal.SIGCONT)  # as Slurm does before it ends a step's tasks
    check_left(run, proc)
    (record,) = run.read_failures()
    assert DID_NOT_RUN in record["error"], record  # the diagnosis names it, not a peer that waited for it


def test_armed_only_on_a_launched_rank_and_an_unfired_watchdog_leaves_no_stack_file(tmp_path: Path) -> None:
    with watchdog.armed(environ={}) as dog:
        assert dog is None  # a plain script: no contract, no watchdog
    contract = LaunchContract(run_dir=str(tmp_path / "run"), recovery=Recovery(hang_min_s=5))
    append_jsonl(RunFolder(contract.run_dir).saves, {"blocking_s": 2.5, "background": False})
    append_jsonl(RunFolder(contract.run_dir).saves, {"blocking_s": 0.1, "background": True})  # its staging only
    environ = {"HPCJOBS_CONTRACT": contract.to_json()}
    with watchdog.armed(env=ENV, environ=environ) as dog:
        assert dog is not None and watchdog.current() is dog and dog.floor == 5 and dog.save_costs == [2.5]
        assert dog.path.exists()  # open for the C timer
        with watchdog.armed(env=ENV, environ=environ) as inner:
            assert inner is None  # one per process
        watchdog.progress(1)
        assert dog.step == 1
    assert watchdog.current() is None and not dog.path.exists()


@pytest.mark.parametrize("mark", ["progress", "alive", "saving", "saved"])
def test_the_marks_do_nothing_when_no_watchdog_is_armed(mark: str) -> None:
    getattr(watchdog, mark)(*([1] if mark in ("progress", "saving") else []))


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], RunFolder]:
    """2 ranks on the local profile (gloo, the tiny model, `recovery: {hang_min_s: 5}`, the collective timeout far
    longer); rank 1 SIGSTOPped after step 20, a hang."""
    tmp_path = tmp_path_factory.mktemp("hung")
    data = {**yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text()),
            "recovery": {"hang_min_s": 5, "max_recoveries": 0}}  # no recovery: the hang's own end is what is seen
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(data))
    run = RunFolder(tmp_path / "run")
    out = hpcjobs("submit", "--profile", str(profile), "--gpus", "2", "--run-dir", str(run.path),
                  "trainers.tasks.lm", "--size", "tiny", "--steps", "100000", "--log-every", "1000",
                  "--ckpt-every", "0", cwd=REPO, timeout=600,
                  env={"HPCJOBS_HOME": str(tmp_path / "home"), "HPCJOBS_FAULT_INJECT": "step@20:1",
                       "HPCJOBS_FAULT_ACTION": "stop", "HPCJOBS_COLLECTIVE_TIMEOUT": "600"})
    return out, run


@pytest.mark.train
def test_the_healthy_ranks_watchdog_ends_a_job_with_a_stopped_rank(
        hung_job: tuple[subprocess.CompletedProcess[str], RunFolder]) -> None:
    """Rank 0's watchdog fires while it waits for rank 1 in a collective, long before the collective timeout: its
    stacks, its `hung:` record with the step, and the job ends with its exit code."""
    out, run = hung_job
    assert out.returncode == HANG_EXIT, out.stdout + out.stderr
    first = run.read_failures()[0]
    assert (first["rank"], first["step"]) == (0, 20), run.read_failures()
    assert first["error"].startswith("hung: no step progress for ") and "(bound 5 s = recovery.hang_min_s" in \
        first["error"]
    stacks = run.stack_file(0, 0).read_text()
    assert "in step" in stacks and "in backward" in stacks, stacks  # waiting in the gradients' all-reduce
    assert stacks.rstrip().endswith(first["error"])
    assert f"every thread's stack in {run.stack_file(0, 0)}" in out.stdout + out.stderr


@pytest.mark.train
def test_the_stopped_rank_leaves_its_stacks_once_it_is_continued(
        hung_job: tuple[subprocess.CompletedProcess[str], RunFolder]) -> None:
    _, run = hung_job
    assert "maybe_die" in run.stack_file(0, 1).read_text() or LATE_NOTE in run.stack_file(0, 1).read_text()
    (record,) = [r for r in run.read_failures() if r["rank"] == 1]
    assert record["error"].startswith("hung: no step progress") and record["step"] == 19


class Marks:
    """Stands in for an armed watchdog: what the integrations mark, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int | None]] = []

    def progress(self, step: int) -> None:
        self.seen.append(("progress", step))

    def alive(self) -> None:
        self.seen.append(("alive", None))

    def saving(self, step: int) -> None:
        self.seen.append(("saving", step))

    def saved(self, until: object = None) -> None:
        self.seen.append(("saved", None))


def test_a_hugging_face_trainer_marks_its_steps_its_saves_and_its_evaluation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from trainers.integrations import hf_trainer

    marks = Marks()
    monkeypatch.setattr(watchdog, "_current", marks)
    callback = hf_trainer.stop_callback()
    args = SimpleNamespace(output_dir=str(tmp_path))
    control = SimpleNamespace(should_save=False, should_training_stop=False, should_evaluate=False)
    callback.on_step_end(args, SimpleNamespace(global_step=4), control)
    control.should_save = True
    callback.on_step_end(args, SimpleNamespace(global_step=5), control)
    callback.on_prediction_step(args, SimpleNamespace(global_step=5), control)
    callback.on_save(args, SimpleNamespace(global_step=5), control)
    assert marks.seen == [("progress", 4), ("progress", 5), ("saving", 5), ("alive", None), ("saved", None)]


def test_a_lightning_trainer_marks_its_batches_its_saves_and_its_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from trainers.integrations import lightning

    marks = Marks()
    monkeypatch.setattr(watchdog, "_current", marks)
    callback = lightning.stop_callback("lightning.pytorch")
    callback.guard = SimpleNamespace(step_ended=lambda: False)
    trainer = SimpleNamespace(global_step=7)
    callback.on_train_batch_end(trainer, None, None, None, 0)
    callback.on_validation_batch_end(trainer, None, None, None, 0, dataloader_idx=0)
    callback.on_save_checkpoint(trainer, None, {})
    assert marks.seen == [("progress", 7), ("alive", None), ("saving", 7)]


FORKS = """
import os, sys, tempfile
from hpcjobs.protocol.runfolder import RunFolder
from trainers import watchdog
from trainers.distenv import DistEnv
from trainers.watchdog import Bound, Watchdog

env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1", master_port=1,
              job_id="7", restart=0, source="single")
watchdog._current = Watchdog(RunFolder(tempfile.mkdtemp()), env, 300.0, Bound(300.0, "test")).start()
pid = os.fork()
if pid == 0:
    sys.exit(3 if watchdog.current() is None else 4)  # a normal exit: the interpreter's finalization runs
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_child_that_exits_normally_does_not_hang_on_the_c_timer(tmp_path: Path) -> None:
    """faulthandler's finalization in a forked child joins the parent's C timer thread, which it does not have: it
    hung for ever before the watchdog stopped that timer across forks."""
    out = subprocess.run([sys.executable, "-c", FORKS], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout == "3\n", out.stdout + out.stderr


def test_a_c_timer_dump_that_progress_followed_is_erased(tmp_path: Path) -> None:
    """The C timer's bound can trail the Python one (a step time that jumped): a dump it made before the rank went
    on is no hang, and must not be left as if it were one."""
    dog = make(tmp_path).start()
    try:
        assert dog.file is not None
        faulthandler.dump_traceback(dog.file)  # as the C timer would
        assert dog.path.stat().st_size > 0
        dog.rearm(dog.base)
        assert dog.path.stat().st_size == 0
    finally:
        dog.stop()
    assert not dog.path.exists()
