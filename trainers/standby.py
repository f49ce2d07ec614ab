"""The signals of a rank whose entry has not joined the stop protocol: a user's script or module until it makes a
StopGuard (`trainers.preemption.install`), maybe never. Nothing in such a script looks at the protocol's flag, so
a flag-only handler swallowed every signal (Ctrl-C printed "every rank commits a checkpoint" and training went on,
`hpcjobs cancel` left the job RUNNING, ranks orphaned under `| tee` ignored kill). Here the signals keep their usual
meaning, and the profile's signal, which only hpcjobs asked Slurm to send, does what the job needs:

  SIGTERM   its default: the kernel ends the rank at once, even inside a collective (the rank started with it
            ignored, see `hpcjobs.request.render.signal_guard`; a scancel, `hpcjobs cancel`, the launcher's death).
  SIGINT    Python's (KeyboardInterrupt), untouched.
  profile's under Slurm rank 0 requeues the job (the restart cap as the protocol has it,
  hpcjobs.protocol.faultpolicy.restartcap:
            a script that saves only on its own shows it no progress, so each requeue counts) and Slurm's SIGTERM
            then stops every rank: a script that saves on its own goes on from its save instead of ending TIMEOUT.
            Without Slurm (the local launcher passes Ctrl-C and cancel on as this signal) a KeyboardInterrupt,
            as Ctrl-C; the launcher then says hpcjobs saved nothing (trainers.launch.interrupted).

A profile whose signal is TERM or INT leaves both at their defaults: a scancel cannot be told from a warning there.
The profile's signal can be lost (sent while the rank was starting with it ignored): under Slurm, rank 0 acts at the
time it was due as if it came (`arm_deadline`), as the protocol's own deadline does for a rank that joined.
Imports nothing that the launcher has not (threading: its log tee): a script pays two signal.signal calls (~25 µs)
at its start, and under Slurm with a time limit one sleeping timer thread on rank 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.faultpolicy import restartcap
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import StopOutcome, StopReason
from trainers import jobenv, preemption
from trainers.jobenv.base import JobEnv


@dataclass
class StandbyState:
    """This rank's standby, one object (as preemption.STATE), not module-global cells."""

    contract: LaunchContract | None = None
    """Set by stand_by(): what the handler reads (a handler takes no arguments of ours)."""
    timers: list[threading.Timer] = field(default_factory=list)
    """The deadline's timer (arm_deadline), cancelled by disarm() once the rank's work is over."""


STANDBY = StandbyState()


def stand_by(contract: LaunchContract) -> None:
    """Give this rank the signals of an entry that has not joined (see the module's doc); `preemption.install`
    replaces them all when the script makes a StopGuard. The job environment is the launcher's
    (`preemption.choose`)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    num = preemption.signal_number(contract.preemption.signal)
    if num not in (signal.SIGTERM, signal.SIGINT):
        STANDBY.contract = contract
        signal.signal(num, _handler)
        arm_deadline(contract)


def arm_deadline(contract: LaunchContract, env: Mapping[str, str] | None = None) -> threading.Timer | None:
    """On rank 0 under Slurm with a known time limit: a daemon timer that calls `overdue` when the profile's signal
    was due at the latest. None where nothing is armed."""
    job = preemption.job_env(env)
    env = os.environ if env is None else env
    due = job.signal_due(contract)
    if due is None or env.get("RANK", "0") != "0" or not job.scheduler_job_id():
        return None
    return _start_timer(due, contract)


def _start_timer(due: float, contract: LaunchContract) -> threading.Timer:
    timer = threading.Timer(max(0.0, due - time.time()), overdue, (contract, due))
    timer.daemon = True  # never keeps a finished script's process alive
    STANDBY.timers[:] = [timer]
    timer.start()
    return timer


def disarm() -> None:
    """The rank's work is over: a deadline passing while the interpreter shuts down must not requeue a job that
    just finished (the launcher calls this where it ignores the late signals, preemption.ignore_from_now)."""
    for timer in STANDBY.timers:
        timer.cancel()
    STANDBY.timers.clear()


def overdue(contract: LaunchContract, due: float, env: Mapping[str, str] | None = None,
            runner: Callable[..., Any] = subprocess.run) -> StopOutcome | None:
    """The time the profile's signal was due has come (a timer thread). Nothing to do if it came, or the script
    joined meanwhile (the protocol's deadline acts). Slurm is asked for the job's EndTime first: a limit extended
    since the start (`scontrol update`) moves the deadline, and the timer is armed again. Else the signal is taken
    as lost: rank 0 requeues as if it came (`act`; the stop's reason is then TIMEOUT)."""
    if preemption.joined() or preemption.STATE.requested:
        return None
    warn = contract.preemption.seconds_before
    end = preemption.job_env(env).end_time_now(runner)
    if end is not None and end - warn > due + 1:
        _start_timer(end - warn, contract)
        return None
    preemption.request_stop(preemption.DEADLINE)
    _say(f"hpcjobs: the {contract.preemption.signal} signal due before the time limit never came (lost at the start "
         "of this run?): acting as if it had")
    return act(preemption.signal_number(contract.preemption.signal), contract, env, runner, name="deadline")


def outcome(env: Mapping[str, str], cap: int, run: RunFolder | None = None, job: JobEnv | None = None,
            ) -> StopOutcome:
    """What the profile's signal does to a rank that has not joined: LOCAL (no Slurm job: stop the script now, as
    Ctrl-C would), REQUEUED (rank 0 requeues, then Slurm stops every rank and starts the job again), STOPPED
    (another rank under Slurm: rank 0 acts for the job, Slurm's SIGTERM ends this one) or CAP (rank 0 at the
    restart cap, `run`'s requeues in a row without a newer checkpoint: the script runs on until Slurm ends the job).
    From the protocol's own `decide`. `job`: the job environment, else the one that applies to `env`."""
    job = job or jobenv.current(env)
    row = restartcap.fruitless(run, job.job_id(), job.requeues(), restartcap.progress(run))
    got = preemption.decide(StopReason.PREEMPTION, job.scheduler_job_id(), len(row), cap)
    if got != StopOutcome.LOCAL and env.get("RANK", "0") != "0":
        return StopOutcome.STOPPED
    return got


def _handler(signum: int, frame: Any) -> None:
    """A Python-level handler: it runs in the main thread between bytecodes, so it may run scontrol and write the
    run folder. Under Slurm the job is requeued once, however many signals come."""
    first = not preemption.STATE.requested
    preemption.request_stop(signum)  # first_request() names it, and the launcher writes no FINISHED for the start
    if (first or not preemption.job_env().scheduler_job_id()) and STANDBY.contract is not None:
        act(signum, STANDBY.contract)


def act(signum: int, contract: LaunchContract, env: Mapping[str, str] | None = None,
        runner: Callable[..., Any] = subprocess.run, name: str = "") -> StopOutcome:
    """What the handler does for `signum` (`outcome`), callable from tests with a stand-in for scontrol; raises
    KeyboardInterrupt for LOCAL. Rank 0's lines go to fd 2 unbuffered: the interrupted code may be inside a print."""
    job, environ = preemption.job_env(env), os.environ if env is None else env
    run = RunFolder(contract.run_dir) if contract.run_dir != preemption.NO_RUN_FOLDER else None
    got = outcome(environ, contract.preemption.max_restarts, run, job)
    if got == StopOutcome.LOCAL:
        raise KeyboardInterrupt  # the launcher says what happened, once the script has unwound
    if got == StopOutcome.STOPPED:
        return got
    name, job_id = name or signal.Signals(signum).name, job.scheduler_job_id()
    why = preemption.stop_reason(contract, env) or StopReason.PREEMPTION
    nothing = ("this script has not joined hpcjobs's stop protocol (no StopGuard), so hpcjobs saved nothing: it goes "
               "on only from what it saved itself")
    done = restartcap.progress(run)
    if got == StopOutcome.CAP:
        row = restartcap.fruitless(run, job.job_id(), job.requeues(), done)
        _say(f"hpcjobs: {name} ({why}): {restartcap.line(contract.preemption.max_restarts, row, done, str(why))}; "
             f"not requeuing job {job_id}: the script runs on until Slurm ends the job ({nothing})")
        return got
    if run:  # before the requeue: the next start must find it
        restartcap.record(run, job.job_id(), restartcap.Requeue(job.requeues() + 1, done, str(why)))
    err = job.requeue(runner)
    if err:
        _say(f"hpcjobs: {name} ({why}): requeue of job {job_id} failed ({err}); the script runs on until Slurm ends "
             "the job")
        return StopOutcome.CAP
    if run:
        run.record_stop(str(why), -1, int(environ.get("HPCJOBS_RESTART", "0")), signal=name, saved_by_hpcjobs=False)
    _say(f"hpcjobs: {name} ({why}): requeued job {job_id}; Slurm now stops the script and starts the job again "
         f"({nothing})")
    return got


def _say(line: str) -> None:
    os.write(2, f"{line}\n".encode())


def reset() -> None:
    disarm()
    STANDBY.contract = None
