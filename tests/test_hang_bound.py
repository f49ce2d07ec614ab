"""Hangs found in seconds by default (issue 40, item 3; trainers/hangbound.py, trainers/watchdog.py): with the
default settings a rank SIGSTOPped on the local profile is found by its peer's watchdog and the job resumes well
within 60 s (it waited for the 120 s collective timeout before); a slow first step, a slow save, a slow evaluation
and a slow step within the learned bound's slack never fire it; a stall the user declares (HPCJOBS_STALL_S) raises
the bound. Timing assertions have wide slack: the machine running them is shared."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import REPO, hpcjobs
from hpcjobs.protocol.contract import LaunchContract, Recovery
from hpcjobs.protocol.runfolder import RunFolder
from trainers import watchdog
from trainers.distenv import DistEnv
from trainers.hangbound import HANG_MIN, floor_of, startup_bound
from trainers.watchdog import Watchdog

ENV = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=1,
              job_id="7", restart=0, source="single")
DEFAULT = float(Recovery().hang_min_s)


class Clock:
    """Stands in for time.monotonic in trainers.watchdog: the tests move it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(watchdog.time, "monotonic", c)
    return c


def default_dog(tmp_path: Path, environ: dict[str, str] | None = None) -> Watchdog:
    """A watchdog as `armed` builds it from the default contract (not started: no thread, no C timer)."""
    floor, how = floor_of(Recovery().hang_min_s, environ or {})
    return Watchdog(RunFolder(tmp_path / "run"), ENV, floor, startup_bound(floor, environ or {}, how), [], how)


def steps(dog: Watchdog, clock: Clock, n: int, seconds: float) -> None:
    for _ in range(n):
        clock.now += seconds
        dog.progress((dog.step or 0) + 1)


def test_by_default_a_hang_after_warm_up_is_found_in_seconds_far_below_the_collective_timeout(
        tmp_path: Path, clock: Clock) -> None:
    """The old floor (300 s) left a hung peer to the 120 s collective timeout."""
    dog = default_dog(tmp_path)
    steps(dog, clock, 10, 0.2)  # 20 × 0.2 s = 4 s: the floor decides
    assert dog.bound().seconds <= 15 and dog.overdue(clock.now + 1) is None
    why = dog.overdue(clock.now + 16)
    assert why is not None and why.startswith("hung: no step progress for 16 s after step 10"), why


def test_a_slow_first_step_is_start_up_not_a_hang(tmp_path: Path, clock: Clock) -> None:
    dog = default_dog(tmp_path)
    assert dog.overdue(clock.now + 240) is None  # compile, warm-up, a checkpoint's load: the start-up bound (300 s)
    steps(dog, clock, 1, 240.0)  # the first step took 4 minutes
    steps(dog, clock, 1, 0.2)
    assert dog.overdue(clock.now + 200) is None  # two step times are not yet a measured bound
    steps(dog, clock, 5, 0.2)
    assert dog.bound().seconds == DEFAULT  # the median, not the slow first step's 240 s, nor the mean


def test_a_slow_save_is_allowed_for_from_its_measured_time_and_before_any_from_the_barriers_wait(
        tmp_path: Path, clock: Clock) -> None:
    dog = default_dog(tmp_path)
    steps(dog, clock, 10, 0.2)
    dog.saving(10)
    assert dog.overdue(clock.now + 600) is None  # no save measured yet: the checkpoint barrier's 1800 s
    clock.now += 600
    dog.saved()
    steps(dog, clock, 5, 0.2)
    dog.saving(15)
    assert dog.overdue(clock.now + 1200) is None  # 4 × the 600 s measured
    clock.now += 700  # slower than the last one, within the allowance
    dog.saved()
    steps(dog, clock, 1, 0.2)
    assert dog.overdue(clock.now + 5) is None and dog.save is None


def test_a_slow_evaluation_marks_each_batch_and_a_slow_step_within_the_slack_never_fires(
        tmp_path: Path, clock: Clock) -> None:
    dog = default_dog(tmp_path)
    steps(dog, clock, 40, 1.0)  # bound 20 × 1 s
    for _ in range(100):  # a 15-minute evaluation, 9 s a batch
        clock.now += 9.0
        assert dog.overdue(clock.now) is None
        dog.alive()
    clock.now += 15.0  # a step fifteen times the median (a log step's sync, the loader refilling)
    assert dog.overdue(clock.now) is None
    dog.progress(41)
    assert dog.bound().seconds == 20.0  # the median moved not at all


def test_a_stall_the_user_declares_raises_the_floor(tmp_path: Path, clock: Clock) -> None:
    assert floor_of(10, {}) == (10.0, HANG_MIN) and floor_of(10, {"HPCJOBS_STALL_S": "5"}) == (10.0, HANG_MIN)
    dog = default_dog(tmp_path, {"HPCJOBS_STALL_S": "120"})
    steps(dog, clock, 10, 0.2)
    assert dog.overdue(clock.now + 100) is None  # the data loader refills its buffer
    assert "(bound 120 s = HPCJOBS_STALL_S; 20 × 0.2 s step time is less)" in str(dog.overdue(clock.now + 130))


def test_armed_reads_the_declared_stall_and_a_malformed_one_keeps_the_floor(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    environ = {"HPCJOBS_CONTRACT": LaunchContract(run_dir=str(tmp_path / "run")).to_json(), "HPCJOBS_STALL_S": "90"}
    with watchdog.armed(env=ENV, environ=environ) as dog:
        assert dog is not None and (dog.floor, dog.floor_how) == (90.0, "HPCJOBS_STALL_S")
    with watchdog.armed(env=ENV, environ={**environ, "HPCJOBS_STALL_S": "soon"}) as dog:
        assert dog is not None and (dog.floor, dog.floor_how) == (DEFAULT, HANG_MIN)
    assert "HPCJOBS_STALL_S='soon'" in capsys.readouterr().err


REAL = """
import sys, time
from hpcjobs.protocol.contract import Recovery
from hpcjobs.protocol.runfolder import RunFolder
from trainers.distenv import DistEnv
from trainers.hangbound import floor_of, startup_bound
from trainers.watchdog import Watchdog

env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1", master_port=1,
              job_id="7", restart=0, source="single")
floor, how = floor_of(Recovery().hang_min_s, {})
dog = Watchdog(RunFolder(sys.argv[1]), env, floor, startup_bound(floor, {}, how), [], how).start()
time.sleep(floor + 3)  # a first step slower than the floor
for step in range(1, 8):
    dog.progress(step)
    time.sleep(0.05)
dog.saving(7)
time.sleep(floor + 3)  # a save slower than the floor, none measured before
dog.saved()
for _ in range(int(floor) + 3):  # an evaluation longer than the floor, its batches marked
    time.sleep(1.0)
    dog.alive()
dog.progress(8)
dog.stop()
print("no hang", flush=True)
"""


@pytest.mark.train
def test_in_real_time_a_slow_first_step_save_and_evaluation_leave_no_record_and_no_stacks(tmp_path: Path) -> None:
    """Both timers running (the thread and faulthandler's C timer), the default floor."""
    run = RunFolder(tmp_path / "run")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(REAL), str(run.path)], cwd=REPO, text=True,
                         capture_output=True, timeout=300)
    assert (out.returncode, out.stdout) == (0, "no hang\n"), out.stderr
    assert run.read_failures() == [] and not run.stack_file(0, 0).exists()


LM = ["trainers.tasks.lm", "--size", "tiny", "--steps", "60", "--log-every", "10", "--ckpt-every", "20"]


def fault_to_resumed(run: RunFolder, rank: int) -> float:
    """From the injected SIGSTOP (trainers/faults.py's line in the rank's log) to the recovered start's first step
    (rank 0's startup.jsonl mark)."""
    m = re.search(r"fault injected \(stop\) at step@\d+, at ([\d.]+)", run.rank_log(0, rank).read_text())
    assert m is not None
    struck = float(m.group(1))
    firsts = [r["first_step"] for r in map(json.loads, run.startup.read_text().splitlines())
              if r.get("rank") == 0 and r.get("restart") == 1 and r.get("first_step")]
    return min(firsts) - struck


@pytest.mark.train
def test_with_the_default_settings_a_stopped_rank_is_found_named_and_resumed_within_a_minute(tmp_path: Path) -> None:
    """The local profile as shipped (no hang_min_s, the 120 s collective timeout): rank 1 SIGSTOPped at step 30 of
    the first start. Before, rank 0 waited for the collective timeout and the job resumed ~130 s after the fault."""
    run = RunFolder(tmp_path / "run")
    profile = yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())
    assert "recovery" not in profile
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run.path), *LM, cwd=REPO,
                  timeout=600, env={"HPCJOBS_HOME": str(tmp_path / "home"), "HPCJOBS_FAULT_INJECT": "step@30:1",
                                    "HPCJOBS_FAULT_ACTION": "stop", "HPCJOBS_FAULT_RESTART": "0"})
    assert out.returncode == 0, out.stderr
    [line] = [r for r in run.read_restarts() if r.get("stopped") == "fault"]
    seconds = fault_to_resumed(run, 1)
    print(f"fault -> first resumed step: {seconds:.1f} s; cause: {line['cause']}")
    assert line["cause"].startswith("rank 1 on ") and "hung:" in line["cause"], line
    assert "hung: no step progress" in run.stack_file(0, 0).read_text()  # the peer's stacks, waiting for rank 1
    assert seconds <= 60, seconds


@pytest.mark.parametrize("declared", [False, True])
def test_a_scripts_own_loop_gets_the_watchdog_only_where_its_longest_pause_is_declared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, declared: bool) -> None:
    """The accelerate `resumable` loop's step ends (trainers/integrations/account.py): its body is the script's own
    and may hold an unmarked evaluation, so only a declared HPCJOBS_STALL_S arms the watchdog; unset, as before."""
    from trainers.integrations.account import Account

    contract = LaunchContract(run_dir=str(tmp_path / "run"))
    for name, value in {"HPCJOBS_CONTRACT": contract.to_json(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    if declared:
        monkeypatch.setenv("HPCJOBS_STALL_S", "300")
    else:
        monkeypatch.delenv("HPCJOBS_STALL_S", raising=False)
    account = Account()
    account.begin(0)
    dog = watchdog.current()
    try:
        assert (dog is not None) == declared
        account.step_done(1)
        account.save_began(tmp_path / "checkpoint-1")
        if dog is not None:
            assert dog.step == 1 and dog.floor == 300 and dog.save is not None
        account.save_done(tmp_path / "checkpoint-1", 1)
        assert dog is None or dog.save is None
    finally:
        account.end()
    assert watchdog.current() is None and getattr(account, "dog", None) is None
