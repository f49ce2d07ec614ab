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
     (a job past its restart cap ends failed instead). Any other SIGTERM leaves the decision to whoever sent it:
     an outside `scontrol requeue` brings the job back, a `scancel` ends it. Every rank exits 0.
Under submitit, whose runner installs its own handler for USR2 and ignores SIGTERM, `install()` is called later and
replaces both, so only this protocol acts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable

_requested: list[tuple[int, float]] = []  # (signal, when): a list append is the whole handler
DEADLINE = 0  # stands for a signal in `_requested`: the time limit is near and the profile's signal never came
# Set by install(): (when to stop if no signal came, job id, seconds_before); empty when no time limit is known.
_deadline: list[tuple[float, str, int]] = []


def _handler(signum: int, frame: Any) -> None:
    _requested.append((signum, time.time()))


def signal_number(name: str) -> int:
    return int(getattr(signal, f"SIG{name.upper().removeprefix('SIG')}"))


def install(signal_name: str = "USR2", env: dict[str, str] | os._Environ[str] | None = None) -> list[int]:
    """Handle the profile's signal and SIGTERM (and SIGINT for local runs) by setting the flag, and arm the
    deadline: the signal can be lost (sent before this rank's step existed, or while the rank was starting with it
    ignored, see `hpcjobs.render.launcher_argv`), so at the time the signal was due the rank stops anyway."""
    nums = sorted({signal_number(signal_name), signal.SIGTERM, signal.SIGINT})
    for num in nums:
        signal.signal(num, _handler)
    env = os.environ if env is None else env
    due = signal_due(env)
    warn = int(env.get("HPCJOBS_SIGNAL_SECONDS", "90"))
    _deadline[:] = [] if due is None else [(due, env.get("SLURM_JOB_ID", ""), warn)]
    return nums


def ignore_from_now(signal_name: str = "USR2") -> None:
    """Ignore the stop signals until the process exits. Called when the rank's work is over: Python gives every
    signal that has a handler its default action back while the interpreter shuts down (which takes seconds with
    torch), and the time-limit signal landing then killed ranks of a job that had just finished (job FAILED,
    measured). An ignored signal stays ignored through shutdown."""
    for num in {signal_number(signal_name), signal.SIGTERM}:
        signal.signal(num, signal.SIG_IGN)


def requested_locally(now: float | None = None, runner: Callable[..., Any] = subprocess.run) -> bool:
    """Has this rank been asked to stop? Also true once the time-limit signal is overdue: then, once, Slurm is asked
    for the job's EndTime first, since the limit may have been extended (`scontrol update`) since the start."""
    if not _requested and _deadline and (now or time.time()) >= _deadline[0][0]:
        due, job_id, warn = _deadline[0]
        end = end_time(job_fields(job_id, runner)) if job_id.isdigit() else None
        if end is not None and end - warn > due + 1:
            _deadline[0] = (end - warn, job_id, warn)
        else:
            _requested.append((DEADLINE, time.time()))
    return bool(_requested)


def end_time(fields: dict[str, str]) -> float | None:
    """`EndTime` of `scontrol show job` (local time) as epoch seconds; None when absent or not a time."""
    try:
        return time.mktime(time.strptime(fields.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def request_stop(signum: int = signal.SIGUSR2) -> None:
    """What the handler does, callable from code and tests."""
    _requested.append((signum, time.time()))


def first_request() -> tuple[str, float] | None:
    """(signal name, time) of the first stop request, if any; the name is `deadline` when no signal came."""
    if not _requested:
        return None
    signum, when = _requested[0]
    return ("deadline" if signum == DEADLINE else signal.Signals(signum).name), when


def reset() -> None:
    _requested.clear()
    _deadline.clear()


def job_end(env: dict[str, str] | os._Environ[str]) -> int | None:
    """When Slurm ends this start of the job (epoch seconds): SLURM_JOB_END_TIME on newer Slurm, else the
    launcher's start time plus the time limit (a few seconds late: the job started before the launcher did)."""
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isdigit():
        return int(end)
    start, limit = env.get("HPCJOBS_START_TIME", ""), env.get("HPCJOBS_TIME_LIMIT", "")
    if start and limit.isdigit() and int(limit) > 0 and "SLURM_JOB_ID" in env:
        return int(float(start)) + int(limit)
    return None


def signal_due(env: dict[str, str] | os._Environ[str]) -> float | None:
    """When the profile's signal is due at the latest (`seconds_before` the end); None without a time limit."""
    end = job_end(env)
    return None if end is None else float(end - int(env.get("HPCJOBS_SIGNAL_SECONDS", "90")))


def stop_reason(env: dict[str, str] | os._Environ[str] | None = None, now: float | None = None) -> str:
    """Why we were asked to stop: `terminated` (SIGTERM under Slurm), `timeout` when the time limit is near,
    `preemption` for the profile's signal otherwise, `interrupt` for a local run (Ctrl-C)."""
    if not _requested:
        return "none"
    env = os.environ if env is None else env
    if _requested[0][0] == signal.SIGTERM and "SLURM_JOB_ID" in env:
        return "terminated"  # preemption without the user signal, scontrol requeue, or scancel: Slurm decides
    if _requested[0][0] == DEADLINE:
        return "timeout"
    due = signal_due(env)
    # The signal comes up to a minute before it is due (Slurm's event resolution; 30 s measured on 22.05).
    if due is not None and (now or time.time()) >= due - 75:
        return "timeout"
    return "preemption" if "SLURM_JOB_ID" in env else "interrupt"  # local runs stop only when asked to


class Agreement:
    """Every rank gets the same answer to "has any rank been asked to stop?" from a tiny all-reduce (MAX) on the CPU.

    `any_rank` answers now and waits for the slowest rank. `any_rank_pipelined` answers with the reduce it started
    on the previous call and starts the next one, so the collective runs in the background during a training step
    instead of stalling every step (measured on 2 CPU ranks: a blocking check cost ~10% of a 15 ms step); the stop
    comes one check later, the same check on every rank. Call `close()` before the group goes away."""

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        self._group = group
        self._flag = torch.zeros(1, dtype=torch.int32)  # lives on the CPU: no device sync
        self._pending: Any = None

    def _single(self) -> bool:
        return self._dist is None or self._dist.get_world_size(self._group) == 1

    def any_rank(self, local: bool) -> bool:
        if self._single():
            return local
        self.close()
        self._flag.fill_(1 if local else 0)
        self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, group=self._group)
        return bool(self._flag.item())

    def any_rank_pipelined(self, local: bool) -> bool:
        if self._single():
            return local
        answer = self.close()
        self._flag.fill_(1 if local else 0)
        self._pending = self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, group=self._group,
                                              async_op=True)
        return answer

    def close(self) -> bool:
        """Wait for a reduce in flight; returns its answer (False if none)."""
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        return bool(self._flag.item())


def job_fields(job_id: str, runner: Callable[..., Any] = subprocess.run) -> dict[str, str]:
    """`scontrol show job -o ID` as a mapping (JobState, PreemptTime, ...); empty when Slurm cannot be asked."""
    try:
        out = runner(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(w.split("=", 1) for w in out.stdout.split() if "=" in w)


def preempted_with_sigterm(job_id: str, runner: Callable[..., Any] = subprocess.run) -> bool:
    """A SIGTERM while the job is still RUNNING with a PreemptTime is a preemption's GraceTime warning (measured on
    22.05). Slurm requeues such a job only if it is still running when the grace ends: a job that saved and exited
    0 in time would end COMPLETED and never come back, so it must requeue itself. A `scancel` (CANCELLED), the
    time limit (TIMEOUT) or an outside `scontrol requeue` change the state before the signal is sent."""
    fields = job_fields(job_id, runner) if job_id.isdigit() else {}
    return fields.get("JobState") == "RUNNING" and fields.get("PreemptTime", "None") not in ("None", "Unknown", "")


def requeue_job(job_id: str, runner: Callable[..., Any] = subprocess.run) -> str:
    """Ask Slurm to requeue this job (rank 0 only); returns Slurm's message, empty when it worked or when Slurm is
    already requeuing it (preemption, `scontrol requeue` from outside: the job is no longer RUNNING)."""
    if not job_id or not job_id.isdigit():
        return f"no Slurm job id ({job_id!r}) to requeue"
    try:
        out = runner(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if out.returncode == 0:
        return ""
    state = job_fields(job_id, runner).get("JobState", "")
    if state and state != "RUNNING":
        return ""
    return (out.stderr or out.stdout).strip() or f"scontrol requeue exited {out.returncode}"


@dataclass
class StopGuard:
    """The public helper for a user's own training script (the submit side's script mode).

        guard = StopGuard()                      # installs the handlers; reads the job's env
        for step in range(start, steps):
            train_step(...)
            if guard.should_stop():              # collective: call it on every rank at the same steps
                save_checkpoint(...)             # trainers.checkpoint.save_checkpoint: atomic
                guard.requeue_and_exit(step)     # rank 0 requeues; every rank exits 0
    """

    signal_name: str = os.environ.get("HPCJOBS_SIGNAL", "USR2")
    group: Any = None

    def __post_init__(self) -> None:
        install(self.signal_name)
        self._agreement: Agreement | None = None

    def should_stop(self) -> bool:
        if self._agreement is None:
            self._agreement = Agreement(self.group)
        return self._agreement.any_rank(requested_locally())

    def requeue_and_exit(self, step: int | None = None) -> None:
        outcome = finish_stop(step)
        raise SystemExit(1 if outcome == "cap" else 0)


def finish_stop(step: int | None) -> str:
    """After the checkpoint is committed on all ranks: record why we stopped and requeue (rank 0) when the stop
    came from the profile's signal. Returns the outcome: `requeued`, `stopped` (SIGTERM: Slurm decides), `cap`
    (restart cap reached: the job must end failed) or `local` (no Slurm: just stop)."""
    import torch.distributed as dist

    from hpcjobs.runfolder import RunFolder

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("HPCJOBS_RESTART", "0"))
    cap = int(os.environ.get("HPCJOBS_MAX_RESTARTS", "10"))
    job_id = os.environ.get("SLURM_JOB_ID", "")
    reason = stop_reason()
    if reason == "terminated" and rank == 0 and preempted_with_sigterm(job_id):
        reason = "preemption"
    if not job_id:
        outcome = "local"
    elif reason == "terminated":
        outcome = "stopped"  # an outside `scontrol requeue` brings the job back, a scancel ends it: Slurm decides
    else:
        outcome = "cap" if restart >= cap else "requeued"
    if rank == 0:
        run = RunFolder(os.environ["HPCJOBS_RUN_DIR"]) if os.environ.get("HPCJOBS_RUN_DIR") else None
        first = first_request()
        if run:
            extra = {"signal": first[0], "signal_to_commit_s": round(time.time() - first[1], 3)} if first else {}
            run.record_stop(reason, step if step is not None else -1, restart, **extra)
        if first and first[0] == "deadline":
            print(f"hpcjobs: the {os.environ.get('HPCJOBS_SIGNAL', 'USR2')} signal due before the time limit never "
                  "came (lost at the start of this run?): stopping on time anyway", flush=True)
        if outcome == "requeued":
            err = requeue_job(job_id)
            print(f"hpcjobs: stop requested ({reason}) at step {step}: checkpoint committed, "
                  f"{'requeued job ' + job_id if not err else 'requeue failed: ' + err}", flush=True)
            if err:
                outcome = "cap"
        elif outcome == "stopped":
            print(f"hpcjobs: stopped by SIGTERM at step {step}: checkpoint committed; Slurm decides whether the job "
                  "comes back (preemption, requeue) or ends (scancel).", flush=True)
        elif outcome == "cap":
            print(f"hpcjobs: stop requested ({reason}) at step {step}: checkpoint committed; restart cap "
                  f"{cap} reached, not requeuing. The job ends failed.", flush=True)
        if run and outcome == "cap":
            run.write_final("failed", f"restart cap {cap} reached ({reason})", step)
    return outcome
