"""Issue 25, items 1 and 5, locally: a user's script that never asks for the stop protocol (no StopGuard) keeps the
usual meaning of Ctrl-C, `hpcjobs cancel` and SIGTERM under `hpcjobs submit --profile local`, also when the submit
is piped through `tee`, with no rank left behind; and a script that leaves its process group open ends with its own
exit status. Real processes, no cluster; the Slurm side of the profile's signal is tested at its decision function.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BIN, REPO, hpcjobs
from hpcjobs.protocol.contract import LaunchContract, Preemption
from hpcjobs.protocol.faultpolicy import restartcap
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import StopOutcome
from trainers import checkpoint, jobenv, preemption, standby

PLAIN = """import os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
out.mkdir(exist_ok=True)
(out / f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
while True:  # a training loop that never asks whether to stop
    time.sleep(0.05)
"""


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for its parent to reap it has stopped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def rank_pids(out: Path, ranks: int = 2, timeout: float = 60) -> list[int]:
    deadline = time.time() + timeout
    while len(pids := sorted(out.glob("rank-*.pid"))) < ranks or not all(p.read_text() for p in pids):
        assert time.time() < deadline, "the ranks never started"
        time.sleep(0.1)
    return [int(p.read_text()) for p in pids]


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The script and the folder its ranks write their pids into; whatever is left running is killed at the end
    (on the old code the ranks trained on as orphans)."""
    script, out = tmp_path / "plain.py", tmp_path / "pids"
    script.write_text(PLAIN)
    yield script, out
    for pid_file in out.glob("rank-*.pid"):
        pid = int(pid_file.read_text() or 0)
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)


def submit(tmp_path: Path, script: Path, out: Path, shell: str = "") -> subprocess.Popen[str]:
    """`hpcjobs submit --profile local --gpus 2 plain.py` in a session of its own, as a terminal runs a foreground
    command (its process group gets the terminal's Ctrl-C); `shell` wraps it (`{} | tee log`)."""
    argv = [str(BIN / "hpcjobs"), "submit", "--profile", "local", "--gpus", "2", "--run-dir", str(tmp_path / "run"),
            str(script), str(out)]
    cmd = ["/bin/sh", "-c", shell.format('"$@"'), "sh", *argv] if shell else argv
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def ended(proc: subprocess.Popen[str], pids: list[int], timeout: float = 60) -> str:
    """The submit's output once it ended, checking that no rank outlived it."""
    out, _ = proc.communicate(timeout=timeout)
    deadline = time.time() + 10  # a rank's own exit after its launcher's: a moment
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], f"ranks left behind: {out}"
    return out


def test_ctrl_c_stops_a_plain_script_at_once(tmp_path: Path, plain: tuple[Path, Path]) -> None:
    proc = submit(tmp_path, *plain)
    pids = rank_pids(plain[1])
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does at Ctrl-C
    out = ended(proc, pids)
    assert proc.returncode == 130, out
    # The launcher's note says the case that applies; rank 0 names what the user did, not the signal it got for it.
    assert "stopping (Ctrl-C): this script has not joined hpcjobs's stop protocol: it stops now" in out
    assert "stopped by Ctrl-C: this script has not joined hpcjobs's stop protocol" in out
    assert "Traceback" not in out
    stop = [json.loads(x) for x in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()][-1]
    assert stop["stopped"] == "interrupt" and stop["saved_by_hpcjobs"] is False
    assert json.loads(hpcjobs("status", "--json").stdout)["state"] == "STOPPED"


def test_a_job_stopped_by_ctrl_c_stays_stopped_once_its_run_folder_is_used_again(tmp_path: Path,
                                                                                  plain: tuple[Path, Path]) -> None:
    """Issue 38: once another job ran on the same --run-dir, the job stopped by Ctrl-C turned UNKNOWN (the local
    backend read the folder's final.json and last line, which were the later job's)."""
    proc = submit(tmp_path, *plain)
    pids = rank_pids(plain[1])
    os.killpg(proc.pid, signal.SIGINT)
    ended(proc, pids)
    stopped = json.loads(hpcjobs("list", "--json").stdout)[0]["job_id"]
    (tmp_path / "quick.py").write_text("print('done')\n")
    again = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(tmp_path / "run"),
                    str(tmp_path / "quick.py"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    states = {j["job_id"]: j["state"] for j in json.loads(hpcjobs("list", "--json").stdout)}
    assert states[stopped] == "STOPPED" and sorted(states.values()) == ["COMPLETED", "STOPPED"], states


def test_ctrl_c_under_tee_leaves_no_rank_behind(tmp_path: Path, plain: tuple[Path, Path]) -> None:
    proc = submit(tmp_path, *plain, shell=f"{{}} | tee {tmp_path / 'log'}")
    pids = rank_pids(plain[1])
    os.killpg(proc.pid, signal.SIGINT)  # hpcjobs and tee both get it: tee is gone before the ranks end
    ended(proc, pids)
    assert "rank 0/2" in (tmp_path / "log").read_text()


def test_cancel_stops_a_plain_script(tmp_path: Path, plain: tuple[Path, Path]) -> None:
    proc = submit(tmp_path, *plain)
    pids = rank_pids(plain[1])
    job = json.loads(hpcjobs("list", "--json").stdout)[0]
    assert job["state"] == "RUNNING"
    said = hpcjobs("cancel", job["job_id"])
    assert said.returncode == 0 and "this script has not joined" in said.stdout + said.stderr, said
    out = ended(proc, pids)
    assert proc.returncode == 143, out  # as a command SIGTERM ended: cancel sends the launcher SIGTERM
    assert "stopping (hpcjobs cancel)" in out and "stopped by hpcjobs cancel:" in out
    assert json.loads(hpcjobs("status", "--json", job["job_id"]).stdout)["state"] == "STOPPED"


def test_sigterm_stops_a_plain_script(tmp_path: Path, plain: tuple[Path, Path]) -> None:
    """`kill` of the submit (as `hpcjobs cancel` sends it) and `kill` of one rank: both stop the whole job."""
    proc = submit(tmp_path, *plain)
    pids = rank_pids(plain[1])
    proc.send_signal(signal.SIGTERM)
    out = ended(proc, pids)
    assert proc.returncode == 143 and "stopped by SIGTERM:" in out, out
    for pid_file in plain[1].glob("*.pid"):
        pid_file.unlink()
    proc = submit(tmp_path, *plain)
    pids = rank_pids(plain[1])
    os.kill(pids[1], signal.SIGTERM)  # the default meaning: the rank ends now, and the launcher ends the others
    ended(proc, pids)
    assert proc.returncode != 0


STUBBORN = """import os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
out.mkdir(exist_ok=True)
(out / f"rank-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
while True:  # a loop that swallows KeyboardInterrupt: only the third Ctrl-C ends it
    try:
        time.sleep(0.05)
    except KeyboardInterrupt:
        pass
"""


def test_a_third_ctrl_c_kills_the_ranks_and_the_job_is_stopped_by_the_user(tmp_path: Path) -> None:
    """Issue 37: it said "ended with code -9" and status FAILED ("killed?") although the user asked for it."""
    script, out = tmp_path / "stubborn.py", tmp_path / "pids"
    script.write_text(STUBBORN)
    proc = submit(tmp_path, script, out)
    pids = rank_pids(out)
    for _ in range(3):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
    said = ended(proc, pids)
    assert proc.returncode == 130, said
    assert "stopped by you (Ctrl-C, then Ctrl-C twice): the ranks were killed" in said and "code -9" not in said
    assert json.loads(hpcjobs("status", "--json").stdout)["state"] == "STOPPED"


def test_a_plain_rank_whose_launcher_died_ends_with_it(tmp_path: Path, plain: tuple[Path, Path]) -> None:
    proc = submit(tmp_path, *plain)
    pids = rank_pids(plain[1])
    proc.kill()  # SIGKILL: the ranks get SIGTERM from the kernel (PR_SET_PDEATHSIG) and keep its default meaning
    ended(proc, pids)


OWN = str(REPO / "trainers" / "examples" / "own_script.py")


@pytest.mark.train
def test_a_stopguard_script_still_saves_at_ctrl_c(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen([str(BIN / "hpcjobs"), "submit", "--profile", "local", "--gpus", "2", "--run-dir",
                             str(run), OWN, "--steps", "1000000"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while "step 100 " not in (log := next(iter(run.glob("logs/restart-0/rank-0.log")), None) or Path(
            os.devnull)).read_text():
        assert time.time() < deadline and proc.poll() is None, log
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out  # saved, but interrupted: as a shell reports it
    stop = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()][-1]
    assert stop["stopped"] == "interrupt" and stop["step"] >= 100 and "saved_by_hpcjobs" not in stop
    assert checkpoint.latest(run / "checkpoints").step == stop["step"]


# --- item 5: a process group left open ----------------------------------------------------------------------------

OPEN_GROUP = """import atexit, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
rank = dist.get_rank()
out = Path(sys.argv[1])
atexit.register(lambda: (out / f"open-at-exit-{rank}").write_text(str(dist.is_initialized())))
if sys.argv[2] == "rank1-first" and rank == 1:
    sys.exit(3)  # one rank leaves first, the other still has the group
if sys.argv[2] == "rank1-first":
    time.sleep(0.5)
print(f"rank {rank} summed {t[0].item()}", flush=True)
"""


@pytest.mark.train
@pytest.mark.parametrize("how,code", [("both", 0), ("rank1-first", 3)])
def test_a_script_that_leaves_its_group_open_ends_with_its_own_code(tmp_path: Path, how: str, code: int) -> None:
    """On the test cluster 1 of 8 such jobs aborted at teardown ("terminate called without an active exception");
    here the launcher ends the group before the interpreter's teardown, whatever the script did (checked by an
    atexit probe in the script: the group is gone by then), three times over."""
    script = tmp_path / "open_group.py"
    script.write_text(OPEN_GROUP)
    for attempt in range(3):
        out_dir = tmp_path / f"out-{attempt}"
        out_dir.mkdir()
        done = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(tmp_path / f"run-{attempt}"),
                       str(script), str(out_dir), how, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=120)
        said = done.stdout + done.stderr
        assert done.returncode == code and "terminate called" not in said and "Abort" not in said, said
        ranks = (0, 1) if how == "both" else (1,)  # rank 0 is then stopped by the launcher (srun's kill-on-bad-exit)
        assert [(out_dir / f"open-at-exit-{r}").read_text() for r in ranks] == ["False"] * len(ranks), said


# --- the profile's signal in a script that does not take part, as each place decides it ---------------------------

CAP = 3


@pytest.mark.parametrize("env,outcome", [
    ({}, StopOutcome.LOCAL),  # no Slurm: stop the script as Ctrl-C would
    ({"RANK": "1"}, StopOutcome.LOCAL),
    ({"SLURM_JOB_ID": "7", "RANK": "0"}, StopOutcome.REQUEUED),
    ({"SLURM_JOB_ID": "7", "RANK": "0", "SLURM_RESTART_COUNT": str(CAP - 1)}, StopOutcome.REQUEUED),
    # no run folder to see progress in: every requeue counts (tests/test_restart_cap.py: with one)
    ({"SLURM_JOB_ID": "7", "RANK": "0", "SLURM_RESTART_COUNT": str(CAP)}, StopOutcome.CAP),
    ({"SLURM_JOB_ID": "7", "RANK": "3"}, StopOutcome.STOPPED),  # rank 0 acts for the job
])
def test_what_the_profiles_signal_does_to_a_script_that_does_not_take_part(env: dict[str, str],
                                                                            outcome: StopOutcome) -> None:
    assert standby.outcome(env, CAP) == outcome


class Scontrol:
    def __init__(self, rc: int = 0, err: str = "", state: str = "RUNNING") -> None:
        self.rc, self.err, self.state, self.calls = rc, err, state, []

    def __call__(self, argv: list[str], **kwargs: object) -> object:
        self.calls.append(argv)
        if argv[1] == "requeue":
            return subprocess.CompletedProcess(argv, self.rc, "", self.err)
        return subprocess.CompletedProcess(argv, 0, f"JobId=7 JobState={self.state}", "")


def test_rank_0_requeues_and_records_a_script_that_does_not_take_part(tmp_path: Path,
                                                                       capfd: pytest.CaptureFixture[str]) -> None:
    contract = LaunchContract(run_dir=str(tmp_path), preemption=Preemption(signal="USR1", max_restarts=CAP))
    ok = Scontrol()
    env = {"SLURM_JOB_ID": "7", "RANK": "0", "HPCJOBS_RESTART": "1"}
    assert standby.act(signal.SIGUSR1, contract, env, ok) == StopOutcome.REQUEUED
    assert ok.calls == [["scontrol", "requeue", "7"]]
    stop = json.loads((tmp_path / "restarts.jsonl").read_text())
    assert (stop["stopped"], stop["signal"], stop["restart"], stop["saved_by_hpcjobs"]) == (
        "preemption", "SIGUSR1", 1, False)
    assert "requeued job 7; Slurm now stops the script" in capfd.readouterr().err
    refused = Scontrol(rc=1, err="Access denied")
    assert standby.act(signal.SIGUSR1, contract, env, refused) == StopOutcome.CAP
    assert "requeue of job 7 failed (Access denied); the script runs on" in capfd.readouterr().err
    other = Scontrol()
    assert standby.act(signal.SIGUSR1, contract, {**env, "RANK": "1"}, other) == StopOutcome.STOPPED
    assert other.calls == []
    capped = Scontrol()
    restartcap.at_start(RunFolder(tmp_path), "7", 3, write=True)  # two more starts, as trainers.launch records them
    assert standby.act(signal.SIGUSR1, contract, {**env, "SLURM_RESTART_COUNT": "3"}, capped) == \
        StopOutcome.CAP  # three requeues in a row brought no checkpoint (tests/test_restart_cap.py: the counting)
    assert capped.calls == [] and "restart cap 3 reached" in capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        standby.act(signal.SIGUSR1, contract, {}, Scontrol())


STAND_BY = """import json, os, signal, sys
from hpcjobs.protocol.contract import LaunchContract, Preemption
from trainers import preemption, standby
contract = LaunchContract(run_dir="", preemption=Preemption(signal=sys.argv[1]))
standby.stand_by(contract)
seen = {"term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "int": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "profile": signal.getsignal(preemption.signal_number(sys.argv[1])) is standby._handler,
        "joined": preemption.joined()}
preemption.StopGuard(contract=contract)
seen["after_guard"] = all(signal.getsignal(s) is preemption._handler for s in (signal.SIGTERM, signal.SIGINT))
seen["joined_after"] = preemption.joined()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("sig", ["USR2", "TERM"])
def test_a_rank_stands_by_with_the_defaults_until_its_script_makes_a_stopguard(sig: str) -> None:
    """Started as a rank is (TERM and the profile's signal ignored by render.signal_guard). A profile whose signal
    is TERM leaves it at its default: a scancel could not be told from a warning."""
    out = subprocess.run(["/bin/sh", "-c", f'trap "" TERM {sig}; exec "$@"', "rank", sys.executable, "-c", STAND_BY,
                          sig], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert json.loads(out.stdout) == {"term": True, "int": True, "profile": sig != "TERM", "joined": False,
                                      "after_guard": True, "joined_after": True}, out.stderr


def test_a_lost_signal_is_acted_on_at_the_time_it_was_due(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The rank starts with the profile's signal ignored (render.signal_guard), so it can be lost: rank 0 of a
    script that has not joined requeues at the time it was due, unless it came, the script joined meanwhile, or
    the limit was extended (Slurm's EndTime)."""
    contract = LaunchContract(run_dir=str(tmp_path), preemption=Preemption(signal="USR1", seconds_before=60),
                              time_limit_s=600, start_time=time.time() - 590)  # due 50 s ago
    env = {"SLURM_JOB_ID": "7", "RANK": "0"}
    due = jobenv.current(env).signal_due(contract)
    assert due is not None
    ended = Scontrol()
    ended.state = "RUNNING EndTime=" + time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(due + 60))
    preemption.reset()
    try:
        preemption.request_stop(signal.SIGUSR1)
        assert standby.overdue(contract, due, env, ended) is None and ended.calls == []  # it came
        preemption.reset()
        preemption.install(contract, {})
        assert standby.overdue(contract, due, env, ended) is None and ended.calls == []  # the script joined
        preemption.reset()
        later = Scontrol()
        later.state = "RUNNING EndTime=" + time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(due + 3660))
        assert standby.overdue(contract, due, env, later) is None  # extended: armed again for the new time
        assert later.calls == [["scontrol", "show", "job", "-o", "7"]]
        assert standby.overdue(contract, due, env, ended) == StopOutcome.REQUEUED
        assert ended.calls[-1] == ["scontrol", "requeue", "7"]
        stop = json.loads((tmp_path / "restarts.jsonl").read_text())
        assert (stop["stopped"], stop["signal"]) == ("timeout", "deadline")
        assert "the USR1 signal due before the time limit never came" in capfd.readouterr().err
        assert standby.arm_deadline(contract, {"RANK": "0"}) is None  # not under Slurm
        assert standby.arm_deadline(contract, {**env, "RANK": "1"}) is None  # rank 0 acts for the job
        assert standby.arm_deadline(LaunchContract(run_dir="r"), env) is None  # no time limit known
        far = LaunchContract(run_dir="r", time_limit_s=3600, start_time=time.time())
        timer = standby.arm_deadline(far, env)
        assert timer is not None and timer.daemon and timer.is_alive()
        standby.disarm()  # the launcher's, once the work is over
        timer.join(5)
        assert not timer.is_alive()
    finally:
        preemption.reset()
        standby.reset()
        for num in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
            signal.signal(num, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
