"""Preemption: a signal only sets a flag; ranks agree at step boundaries; save, then one rank requeues.

The protocol, the same for the shared trainer and for users' own scripts (see `StopGuard`):
  1. Slurm sends the profile's signal (at preemption with preempt_send_user_signal, and `seconds_before` the time
     limit) or SIGTERM (preemption with GraceTime, `scontrol requeue`, scancel). The handler records which signal
     arrived and does nothing else: no I/O, no collectives, no logging. A rank starts with these signals ignored
     until the handler is in place (a signal in the first instant of a start would otherwise kill it and fail the
     job), and stops by itself when the time-limit signal is due but never came.
  2. At each step boundary the ranks combine their flags with one tiny all-reduce (MAX), on the CPU (a gloo group
     when the training backend is NCCL), so all ranks stop at the same step without a host-device sync. The
     trainer pipelines it (the answer of the reduce started one step earlier; it runs during the step).
  3. All ranks save a checkpoint (atomic) and wait at a barrier. If the stop came from the profile's signal (the
     time limit, a preemption with preempt_send_user_signal, `scancel --signal`) or from the SIGTERM of a
     preemption's GraceTime (Slurm would not requeue a job that ended in time), rank 0 runs `scontrol requeue`
     (a job whose last `max_restarts` requeues brought no newer checkpoint ends failed instead: the restart cap,
     hpcjobs.protocol.faultpolicy.restartcap). Any other SIGTERM leaves the decision to whoever sent it: an outside
     `scontrol requeue` brings the job back, a `scancel` ends it. Every rank exits 0.
Under submitit, whose runner installs its own handler for USR2 and ignores SIGTERM, `install()` is called later and
replaces both, so only this protocol acts. Which signal, how long before the end, the restart cap and the run folder
all come from the launch contract (hpcjobs.protocol.contract), passed in explicitly, never read at import time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hpcjobs.protocol import userstop
from hpcjobs.protocol.contract import EARLY_SIGNAL_S, LaunchContract
from hpcjobs.protocol.faultpolicy import restartcap
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import FinalState, StopOutcome, StopReason
from trainers import jobenv, ranklog
from trainers.agreement import Agreement
from trainers.jobenv.base import JobEnv

DEADLINE = 0  # stands for a signal in `STATE.requested`: the time limit is near and the profile's signal never came


@dataclass
class StopState:
    """This rank's side of the stop protocol: one object, not module-global cells. A signal handler only appends
    to `requested` (a list append is the whole handler: nothing else may run inside one)."""

    requested: list[tuple[int, float]] = field(default_factory=list)
    """(signal, when) of every stop request, in order."""
    joined: bool = False
    """install() ran: the entry takes part in the protocol."""
    deadline: tuple[float, JobEnv, int] | None = None
    """install(): when to stop if no signal came, the job, its warning."""
    job: JobEnv | None = None
    """The job environment the launcher chose at the start (`choose`); None outside a launched rank."""


STATE = StopState()
NO_RUN_FOLDER = ""
"""The run folder of a contract made outside a launched rank (a user's script under plain torchrun): a stop is then
recorded nowhere, since no hpcjobs command will look for it, and nothing is written into the working directory."""


def choose(job: JobEnv | None) -> None:
    """The launcher's job environment for the rest of the rank (its DistEnv's): asked again after the launcher
    exported RANK/WORLD_SIZE, `jobenv.current()` would take a single process for a torchrun rank."""
    STATE.job = job


def job_env(env: Mapping[str, str] | None = None) -> JobEnv:
    """The job environment: the start's (`choose`) unless `env` is given; outside a launched rank (a user's script
    under plain torchrun, tests) the one that applies to `env` (os.environ when None)."""
    if env is None and STATE.job is not None:
        return STATE.job
    return jobenv.current(env)


def _handler(signum: int, frame: Any) -> None:
    STATE.requested.append((signum, time.time()))


def signal_number(name: str) -> int:
    return int(getattr(signal, f"SIG{name.upper().removeprefix('SIG')}"))


def current_contract() -> LaunchContract:
    """The contract the launcher exported for this rank; outside a launched rank (a user's script started by
    torchrun or by hand) the defaults with no run folder (see NO_RUN_FOLDER). Read when called, never at import,
    so a contract exported after this module was imported (submitit, tests) is the one used."""
    return LaunchContract.current() or LaunchContract(run_dir=NO_RUN_FOLDER)


def install(contract: LaunchContract, env: Mapping[str, str] | None = None, announce: bool = True) -> list[int]:
    """Handle the profile's signal and SIGTERM (and SIGINT for local runs) by setting the flag, and arm the
    deadline: the signal can be lost (sent before this rank's step existed, or while the rank was starting with it
    ignored, see `hpcjobs.request.render.launcher_argv`), so at the time the signal was due the rank stops anyway.
    From here on the rank takes part in the protocol (`joined`): the shared trainer, or a script's StopGuard."""
    nums = sorted({signal_number(contract.preemption.signal), signal.SIGTERM, signal.SIGINT})
    for num in nums:
        signal.signal(num, _handler)
    STATE.joined = True
    if announce and int((os.environ if env is None else env).get("RANK", "0")) == 0:  # for the launcher's Ctrl-C line
        run = RunFolder(contract.run_dir) if contract.run_dir != NO_RUN_FOLDER else None
        userstop.set_joined(run, (os.environ if env is None else env).get("HPCJOBS_JOB_ID"), True)
    job = job_env(env)
    due = job.signal_due(contract)
    warn = contract.preemption.seconds_before
    STATE.deadline = None if due is None else (due, job, warn)
    return nums


def joined() -> bool:
    """Whether this rank's entry takes part in the protocol (the shared trainer, or a StopGuard was made); until
    then a user's script stands by with the usual meaning of its signals (trainers.standby)."""
    return STATE.joined


def ignore_from_now(contract: LaunchContract) -> None:
    """Ignore the stop signals until the process exits. Called when the rank's work is over: Python gives every
    signal that has a handler its default action back while the interpreter shuts down (which takes seconds with
    torch), and the time-limit signal landing then killed ranks of a job that had just finished (job FAILED,
    measured). An ignored signal stays ignored through shutdown. A rank that never joined the protocol keeps
    SIGTERM's default: a script whose teardown hangs stays stoppable by kill, cancel and its launcher's death."""
    nums = {signal_number(contract.preemption.signal), signal.SIGTERM} if joined() else {
        signal_number(contract.preemption.signal)} - {signal.SIGINT, signal.SIGTERM}
    for num in nums:
        signal.signal(num, signal.SIG_IGN)


def requested_locally(now: float | None = None, runner: Callable[..., Any] = subprocess.run) -> bool:
    """Has this rank been asked to stop? Also true once the time-limit signal is overdue: then, once, Slurm is asked
    for the job's EndTime first, since the limit may have been extended (`scontrol update`) since the start."""
    if not STATE.requested and STATE.deadline and (now or time.time()) >= STATE.deadline[0]:
        due, job, warn = STATE.deadline
        end = job.end_time_now(runner)
        if end is not None and end - warn > due + 1:
            STATE.deadline = (end - warn, job, warn)
        else:
            STATE.requested.append((DEADLINE, time.time()))
    return bool(STATE.requested)


def signalled() -> bool:
    """Has a stop signal come (or `request_stop`)? Unlike `requested_locally`, an overdue time limit does not count
    and Slurm is never asked: what a rank that has not begun yet may look at (its start may itself have taken
    longer than the time left before the deadline, and then it must still join the others to stop with them)."""
    return any(signum != DEADLINE for signum, _ in STATE.requested)


def request_stop(signum: int) -> None:
    """What the handler does for `signum`, callable from code and tests."""
    STATE.requested.append((signum, time.time()))


def first_request() -> tuple[str, float] | None:
    """(signal name, time) of the first stop request, if any; the name is `deadline` when no signal came."""
    if not STATE.requested:
        return None
    signum, when = STATE.requested[0]
    return ("deadline" if signum == DEADLINE else signal.Signals(signum).name), when


def reset() -> None:
    STATE.requested.clear()
    STATE.deadline = None
    STATE.joined = False
    STATE.job = None


def stop_reason(contract: LaunchContract, env: Mapping[str, str] | None = None, now: float | None = None,
                unasked: bool = False) -> StopReason | None:
    """Why we were asked to stop (None: we were not, unless `unasked`): TERMINATED (SIGTERM under a scheduler),
    TIMEOUT when the time limit is near, PREEMPTION for the profile's signal otherwise, INTERRUPT for a local run
    (Ctrl-C), SIGNAL for any other signal under a scheduler, or for a stop no request reached (`unasked`: a script's
    own KeyboardInterrupt; a SIGINT after a node came back was recorded as a local Ctrl-C's word, measured)."""
    job = job_env(env)
    scheduled = bool(job.scheduler_job_id())
    if not STATE.requested:
        return (StopReason.SIGNAL if scheduled else StopReason.INTERRUPT) if unasked else None
    if STATE.requested[0][0] == signal.SIGTERM and scheduled:
        return StopReason.TERMINATED  # preemption without the user signal, scontrol requeue, or scancel: Slurm decides
    if STATE.requested[0][0] == DEADLINE:
        return StopReason.TIMEOUT
    if scheduled and STATE.requested[0][0] != signal_number(contract.preemption.signal):
        return StopReason.SIGNAL
    due = job.signal_due(contract)
    if due is not None and (now or time.time()) >= due - EARLY_SIGNAL_S:
        return StopReason.TIMEOUT
    return StopReason.PREEMPTION if scheduled else StopReason.INTERRUPT  # local runs stop only when asked to


@dataclass
class StopGuard:
    """The public helper for a user's own training script (the submit side's script mode).

        guard = StopGuard()                      # installs the handlers; reads the launch contract
        for step in range(start, steps):
            train_step(...)
            if guard.should_stop():              # collective: call it on every rank at the same steps
                save_checkpoint(...)             # trainers.checkpoint.save_checkpoint: atomic
                guard.requeue_and_exit(step)     # rank 0 requeues; every rank exits 0

    The contract is read when the guard is made (`current_contract()`): under hpcjobs, the launcher's (the
    profile's signal, restart cap and run folder); outside it, the defaults of hpcjobs.protocol.contract with no run
    folder.
    `signal_name` overrides the contract's signal (a script sent by its own `sbatch --signal=USR1@…`)."""

    signal_name: str | None = None
    group: Any = None
    contract: LaunchContract | None = None

    def __post_init__(self) -> None:
        contract = self.contract or current_contract()
        if self.signal_name:
            signal_number(self.signal_name)  # an unknown name fails here, not at the first signal
            name = self.signal_name.upper().removeprefix("SIG")
            contract = replace(contract, preemption=replace(contract.preemption, signal=name))
        self.contract = contract
        install(contract)
        self._agreement: Agreement | None = None

    @property
    def launch_contract(self) -> LaunchContract:
        assert self.contract is not None  # set by __post_init__
        return self.contract

    def should_stop(self, pipelined: bool = False) -> bool:
        """Whether any rank was asked to stop. `pipelined`: the answer to the previous call's question, whose reduce
        ran during the step in between (bench/stop_agreement.py: 0.38 ms a step at 2 gloo ranks here, against 1.5
        ms blocking); every rank still gets the same answer at the same call, one call later."""
        if self._agreement is None:  # made at the first check, which every rank makes at the same step
            self._agreement = Agreement(cpu_group(self.group))
        local = requested_locally()
        return self._agreement.any_rank_pipelined(local) if pipelined else self._agreement.any_rank(local)

    def close(self) -> None:
        """Wait for a pipelined reduce still in flight: once the loop is over, before the group goes away."""
        if self._agreement is not None:
            self._agreement.close()

    def requeue_and_exit(self, step: int | None = None) -> None:
        self.close()  # a pipelined reduce still in flight, before the group's barrier
        # The agreement's group (CPU, made at the first check): a script's NCCL default group may time out sooner.
        outcome = finish_stop(step, self.launch_contract, group=self._agreement.group if self._agreement else None)
        raise SystemExit(1 if outcome == StopOutcome.CAP else 0)


def cpu_group(group: Any = None) -> Any:
    """A group that can all-reduce the CPU stop flag: `group` when given, the default group when it has a CPU
    backend, else a new gloo group over all ranks (collective: every rank must call it at the same point). A script
    that called init_process_group("nccl") has no CPU backend on its default group: the flag's all-reduce fails
    there ("No backend type associated with device type cpu"), as the trainer's control group already knows."""
    import torch.distributed as dist

    if group is not None or not (dist.is_available() and dist.is_initialized()):
        return group
    config = getattr(dist, "get_backend_config", None)
    has_cpu = "cpu:" in config() if config else dist.get_backend() == "gloo"
    return None if has_cpu else dist.new_group(backend="gloo")


def _barrier(group: Any = None) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def decide(reason: StopReason, job_id: str, in_a_row: int, cap: int) -> StopOutcome:
    """What a start does once its stop checkpoint is committed, from why it stopped, where it runs (`job_id`: the
    scheduler's; empty where none owns the job) and `in_a_row`, what the cap counts
    (hpcjobs.protocol.faultpolicy.restartcap)."""
    if not job_id:
        return StopOutcome.LOCAL
    if reason == StopReason.TERMINATED:
        return StopOutcome.STOPPED  # an outside `scontrol requeue` brings the job back, a scancel ends it
    return StopOutcome.CAP if in_a_row >= cap else StopOutcome.REQUEUED


def finish_stop(step: int | None, contract: LaunchContract, env: Mapping[str, str] | None = None,
                runner: Callable[..., Any] = subprocess.run, group: Any = None) -> StopOutcome:
    """After the checkpoint is committed on all ranks: record why we stopped and requeue (rank 0) when the stop
    came from the profile's signal. Returns the outcome: REQUEUED, STOPPED (SIGTERM: Slurm decides), CAP (restart
    cap reached, or the requeue failed: the job must end failed) or LOCAL (no Slurm: just stop). The restart cap,
    the run folder and the signal's name come from `contract`; `runner` runs scontrol (tests pass a stand-in).
    `group`: the barrier's, where the default group's timeout is short (the trainer's NCCL group drops to the
    collective timeout after the first step, and rank 0 may spend longer closing its trackers first)."""
    _barrier(group)
    job_id = (job := job_env(env)).scheduler_job_id()
    reason = stop_reason(contract, env, unasked=True) or StopReason.SIGNAL  # unasked: always a word
    env = os.environ if env is None else env
    rank, restart = int(env.get("RANK", "0")), int(env.get("HPCJOBS_RESTART", "0"))
    if reason == StopReason.TERMINATED and rank == 0 and job.preempted_with_sigterm(runner):
        reason = StopReason.PREEMPTION
    run = RunFolder(contract.run_dir) if contract.run_dir != NO_RUN_FOLDER else None
    done = restartcap.progress(run)  # the newest committed checkpoint: this stop's, or an earlier one
    row = restartcap.fruitless(run, job.job_id(), job.requeues(), done)
    outcome = decide(reason, job_id, len(row), cap := contract.preemption.max_restarts)
    if rank != 0:
        return outcome
    _record_stop(run, reason, step, restart, contract)
    why = restartcap.line(cap, row, done, str(reason))
    if outcome == StopOutcome.REQUEUED:
        if run:  # before the requeue: the next start must find it
            restartcap.record(run, job.job_id(), restartcap.Requeue(job.requeues() + 1, done, str(reason)))
        err = job.requeue(runner)
        ranklog.say(f"hpcjobs: stop requested ({reason}) at step {step}: checkpoint committed, "
                    f"{'requeued job ' + job_id if not err else 'requeue failed: ' + err}", rank=rank)
        outcome, why = (StopOutcome.CAP, f"the requeue failed: {err}") if err else (outcome, why)
    elif outcome == StopOutcome.STOPPED:
        ranklog.say(f"hpcjobs: stopped by SIGTERM at step {step}: checkpoint committed; Slurm decides whether the "
                    "job comes back (preemption, requeue) or ends (scancel).", rank=rank)
    elif outcome == StopOutcome.CAP:
        ranklog.say(f"hpcjobs: stop requested ({reason}) at step {step}: checkpoint committed; {why}: not "
                    "requeuing. The job ends failed.", rank=rank)
    if run and outcome in (StopOutcome.LOCAL, StopOutcome.STOPPED):
        when = "to resume" if outcome == StopOutcome.LOCAL else "if Slurm does not bring the job back, to resume"
        by = userstop.asked_by(run, env.get("HPCJOBS_JOB_ID"))  # what the user did (a local job)
        again = (f"the same command with --run-dir {run.path}" if contract.points else  # a sweep starts fresh points
                 f"the same command again (it continues {run.path}; --run-dir names it)")
        ranklog.say(f"hpcjobs: stopped{' by ' + by if by else ''} at step {step} with a committed checkpoint; {when}, "
                    f"run {again}", rank=rank)
    if run and outcome == StopOutcome.CAP:
        run.write_final(FinalState.FAILED, why, step, job_id=env.get("HPCJOBS_JOB_ID") or job_id or None)
    return outcome


def _record_stop(run: RunFolder | None, reason: StopReason, step: int | None, restart: int,
                 contract: LaunchContract) -> None:
    """restarts.jsonl gets why this start stopped, which signal asked and how long the checkpoint took after it."""
    first = first_request()
    if run:
        extra = {"signal": first[0], "signal_to_commit_s": round(time.time() - first[1], 3)} if first else {}
        run.record_stop(str(reason), step if step is not None else -1, restart, **extra)
    if first and first[0] == "deadline":
        ranklog.say(f"hpcjobs: the {contract.preemption.signal} signal due before the time limit never came (lost at "
                    "the start of this run?): stopping on time anyway", rank=0)  # called on rank 0 only
