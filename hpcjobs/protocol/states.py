"""The words both sides use for how things stand and how they ended, as enums (the strings are what files hold).

Torch-free: the node side writes them into the run folder, the submit side reads them back.
"""

from __future__ import annotations

from enum import Enum


class _Str(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


class StopReason(_Str):
    """Why a start of the job stopped before finishing (restarts.jsonl `stopped`)."""

    PREEMPTION = "preemption"
    """The profile's signal while the time limit was still far, or a preemption's GraceTime SIGTERM."""
    TIMEOUT = "timeout"
    """The time limit is near: the profile's signal came `seconds_before` it, or it was due and never came."""
    TERMINATED = "terminated"
    """SIGTERM under Slurm that was not a preemption (scancel, an outside `scontrol requeue`): Slurm decides."""
    INTERRUPT = "interrupt"
    """A local run asked to stop (Ctrl-C, SIGTERM)."""
    SIGNAL = "signal"
    """Under a scheduler, a signal that is neither the profile's nor SIGTERM (a stray SIGINT, say): not a local
    Ctrl-C, nor a preemption or the time limit. The trainer still stops at a checkpoint and requeues, as it did
    for it before it had its own word; restarts.jsonl's `signal` names which."""
    FAULT = "fault"
    """A rank or node failed and it was nobody's bug (hpcjobs.protocol.faultpolicy.kinds): the job recovers by itself,
    its ranks started again from the newest finished checkpoint (the line's `recovery` says how)."""


class StopOutcome(_Str):
    """What a start does after its stop checkpoint is committed."""

    REQUEUED = "requeued"
    STOPPED = "stopped"
    """Left to Slurm (SIGTERM): a requeue brings the job back, a scancel ends it."""
    CAP = "cap"
    """The restart cap is reached: the job ends failed."""
    LOCAL = "local"
    """No scheduler to come back through: just stop (resume by running it again)."""


class FinalState(_Str):
    """How a run ended for good (final.json `state`)."""

    FINISHED = "finished"
    FAILED = "failed"


class JobState(_Str):
    """A job's state as `hpcjobs status` reports it: Slurm's job state codes, plus STOPPED and UNKNOWN."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    REQUEUED = "REQUEUED"
    REQUEUE_FED = "REQUEUE_FED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RESIZING = "RESIZING"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    PREEMPTED = "PREEMPTED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    NODE_FAIL = "NODE_FAIL"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    REVOKED = "REVOKED"
    STOPPED = "STOPPED"
    """A local run that checkpointed and stopped when asked (resumable), or Slurm's own STOPPED."""
    REFUSED = "REFUSED"
    """Its ranks refused to start (exit code 2 and one line: a flag the node cannot use, a resume under other
    settings): nothing ran and nothing of the run changed; not a failure (hpcjobs.follow.refused)."""
    UNKNOWN = "UNKNOWN"
    """Nothing could tell: no scheduler answer and no marker in the run folder."""

    @classmethod
    def parse(cls, text: str) -> JobState:
        """A state word as squeue/sacct print it ("CANCELLED by 0" → CANCELLED); UNKNOWN for anything else."""
        word = text.strip().split(" ")[0].upper() if text.strip() else ""
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATES


FINISHED_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT,
                             JobState.OUT_OF_MEMORY, JobState.NODE_FAIL, JobState.BOOT_FAIL, JobState.DEADLINE,
                             JobState.REVOKED, JobState.STOPPED, JobState.REFUSED})
"""States a job does not leave by itself."""
