"""Goodput: where a job's wall time and GPU-hours went, from what the ranks, the launcher and the scheduler recorded.

Pure: the records come in as `JobTimes` (hpcjobs.goodput.records reads them from a run folder, the job store and the
scheduler), and the buckets come out. A job's timeline is cut at its recorded instants, in this order:

  submitted → (queue) → a start begins → (startup: launch, imports, rendezvous, build and load, first step) →
  first step done → (productive | checkpoint | rework) → the start's last record → (requeue hold | queue |
  recovery) → the next start begins … → the last start's last record → (other) → the job ended

so the buckets add up to the wall time exactly. Instants that clocks put out of order (ranks on other nodes, a
record written late) are taken as their running maximum: a bucket is never negative and the sum still telescopes.

- queue: submitted → the first start began (Slurm: the allocation's start; elsewhere: the first rank launched), and
  after a requeue, eligible → the next allocation's start (where sacct says when the job was eligible again).
- startup: a start's begin → its slowest rank's first step done (imports, rendezvous, model build, checkpoint load,
  the first step with its compilation).
- checkpoint: the time the training loop waited in saves (RUN/saves.jsonl: a foreground save's write and commit, a
  background save's staging).
- rework: training time of the steps a later start did again: from when this start passed the step the next start
  resumed at (that save's record) to its last record; all of its training when nothing it saved was resumed. For
  the run's last start, when it ended without finishing, the steps past the newest finished checkpoint.
- detection: a fault's time to be noticed: from the last progress of a hung rank (its watchdog record's `idle_s`) to
  the start's end. Neither training nor redone steps: before, a hang's wait was booked as rework (181.7 s of
  "rework" for 20 steps redone, issue 40).
- productive: the rest of the training time (evaluations and logging included).
- requeue_hold: Slurm's hold of a requeued job (previous allocation's end → eligible again; cred_expire).
- recovery: the rest of the gap between a start's last record and the next start's begin (its ranks exiting, the
  requeue or relaunch, the queue when the scheduler cannot say).
- other: a finished start's work after its training's last record (a script's own final save_model, an upload), and
  the last start's last record → the job's end (interpreter and job script shutdown), or nothing when the
  job's end is not known (the job's end is then its last record) or it still runs (the end is now). A job that
  waits to start again (requeued, pending) counts the time since its last start's last record as recovery.

ETTR = productive / allocated, allocated = wall − queue − requeue_hold; GPU-hours count only the allocated buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcjobs.protocol.runfolder import FIRST_STEP, STARTUP_MARKS

BUCKETS = ("queue", "startup", "productive", "checkpoint", "rework", "detection", "requeue_hold", "recovery", "other")
UNALLOCATED = frozenset({"queue", "requeue_hold"})
"""Buckets in which the job held no GPUs."""
STARTUP_PARTS = ("launch", "imports", "rendezvous", "build_and_load", "first_step")
INTERRUPTED = frozenset({"stopped", "failed", "lost"})
MARKS = STARTUP_MARKS
"""trainers/startup.py's marks (hpcjobs.protocol.runfolder spells them for both sides): each startup part ends at
the mark of the same position."""


@dataclass(frozen=True)
class Save:
    step: int
    time: float
    blocking_s: float
    background: bool = False


@dataclass(frozen=True)
class AllocationTimes:
    """One allocation of the job by its scheduler (a requeued Slurm job has one per start)."""

    start: float | None
    end: float | None
    eligible: float | None = None


@dataclass(frozen=True)
class Start:
    """One (re)start of the job's ranks, as the run folder recorded it."""

    restart: int
    begin: float
    marks: dict[str, float] = field(default_factory=dict)
    """The slowest rank's startup marks (trainers/startup.py), absent when no rank reached its first step."""
    start_step: int | None = None
    end: float | None = None
    """Its last record; None while it runs (then: now)."""
    end_step: int | None = None
    ended: str = "lost"
    """finished | failed | stopped (at a checkpoint, when asked) | lost (no word: killed) | running."""
    saves: tuple[Save, ...] = ()
    stop_to_commit_s: float | None = None
    tier: str | None = None
    """Which checkpoint tier this start resumed from, where it said (trainers.localtier: local tier, peer replica,
    shared storage)."""
    fault_at: float | None = None
    """When a failed or lost start stopped making progress (a hung rank's last progress, from its watchdog record),
    if that is known and before `end`: the rest of it is detection, not training."""
    trained_until: float | None = None
    """A finished start's newest record of its last step (its training's end); what came after it up to `end` (the
    script's own work after training: a final save_model, an upload, the interpreter's exit) is "other"."""


@dataclass(frozen=True)
class JobTimes:
    job_id: str
    gpus: int
    submitted: float | None
    starts: tuple[Start, ...]
    end: float | None = None
    """When the job ended (the scheduler's or the local launcher's word); None: unknown, or still running."""
    allocations: tuple[AllocationTimes, ...] = ()
    running: bool = False
    """Its last start still runs (it ends now)."""
    waiting: bool = False
    """Not ended, but no start runs: requeued and pending again (the time since its last start counts as recovery)."""
    marks_recorded: bool = True
    """The ranks record startup marks (a run folder without startup.jsonl is older, or never trained): without
    them no start says when it began to train, and the ETTR is unknown."""


@dataclass
class Goodput:
    job_id: str
    gpus: int
    wall_s: float = 0.0
    buckets: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    startup_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STARTUP_PARTS, 0.0))
    starts: int = 0
    interruptions: int = 0
    """Starts that ended without finishing (stopped, failed, lost)."""
    known: bool = True
    """Whether productive time could be told at all (JobTimes.marks_recorded); the ETTR is None when not."""
    holds: int = 0
    """Gaps in which Slurm held the requeued job (its accounting says when it was eligible again)."""
    gpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    """Per bucket, seconds × the job's GPUs (0 where it held none): summed as they are into a total."""

    @property
    def allocated_s(self) -> float:
        return self.wall_s - sum(self.buckets[b] for b in UNALLOCATED)

    @property
    def ettr(self) -> float | None:
        return self.buckets["productive"] / self.allocated_s if self.allocated_s > 0 and self.known else None

    def gpu_hours(self) -> dict[str, float]:
        return {b: s / 3600 for b, s in self.gpu_seconds.items()}

    def add(self, other: Goodput) -> None:
        """Sum `other` into this one (a sweep's total)."""
        self.wall_s += other.wall_s
        for b in BUCKETS:
            self.buckets[b] += other.buckets[b]
            self.gpu_seconds[b] += other.gpu_seconds[b]
        for p in STARTUP_PARTS:
            self.startup_parts[p] += other.startup_parts[p]
        self.starts += other.starts
        self.interruptions += other.interruptions
        self.holds += other.holds
        self.known = self.known and other.known

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "gpus": self.gpus, "wall_s": round(self.wall_s, 3),
                "allocated_s": round(self.allocated_s, 3), "ettr": None if self.ettr is None else round(self.ettr, 4),
                "buckets_s": {b: round(s, 3) for b, s in self.buckets.items()},
                "startup_s": {p: round(s, 3) for p, s in self.startup_parts.items()},
                "gpu_hours": {b: round(h, 6) for b, h in self.gpu_hours().items()},
                "starts": self.starts, "interruptions": self.interruptions, "requeue_holds": self.holds,
                "training_known": self.known}  # False: "startup" holds the training too, "productive" is unknown


class Clock:
    """Instants taken in order: each is at least the one before, so the spans between them telescope."""

    def __init__(self, t0: float) -> None:
        self.now = t0

    def to(self, t: float | None) -> float:
        """The span from the last instant to `t` (0 for an unknown or earlier `t`); `t` becomes the last."""
        if t is None or t <= self.now:
            return 0.0
        span, self.now = t - self.now, t
        return span


def compute(job: JobTimes, resumed_next: Sequence[int | None], now: float) -> Goodput:
    """The job's buckets. `resumed_next[i]`: the step the start after `job.starts[i]` resumed at (that start may
    belong to a later job on the same run folder), or None when no later start resumed (then nothing is rework)."""
    out = Goodput(job.job_id, job.gpus, starts=len(job.starts), known=job.marks_recorded)
    if not job.starts:
        return out
    first = job.starts[0].begin
    t0 = min(first, job.submitted) if job.submitted is not None else first
    clock = Clock(t0)
    out.buckets["queue"] += clock.to(first)
    for i, start in enumerate(job.starts):
        end = now if start.end is None else start.end
        _one_start(out, clock, start, end, resumed_next[i])
        if i + 1 < len(job.starts):
            gap_end = job.starts[i + 1].begin
            _gap(out, clock.now, gap_end, job.allocations)
            clock.to(gap_end)
    out.interruptions = sum(s.ended in INTERRUPTED for s in job.starts)
    job_end = now if job.running or job.waiting else job.end
    out.buckets["recovery" if job.waiting else "other"] += clock.to(job_end)
    out.wall_s = clock.now - t0
    out.gpu_seconds = {b: 0.0 if b in UNALLOCATED else s * job.gpus for b, s in out.buckets.items()}
    return out


def _one_start(out: Goodput, clock: Clock, start: Start, end: float, resumed: int | None) -> None:
    trained = start.marks.get(FIRST_STEP)
    for part, mark in zip(STARTUP_PARTS, MARKS, strict=True):
        stamp = start.marks.get(mark)
        if stamp is not None:
            span = clock.to(min(stamp, max(end, clock.now)))
            out.startup_parts[part] += span
            out.buckets["startup"] += span
    if trained is None:  # never trained: all of it was start-up
        span = clock.to(end)
        out.startup_parts["first_step"] += span
        out.buckets["startup"] += span
        return
    t_train = clock.now
    until = start.trained_until if start.trained_until is not None else start.fault_at
    train = clock.to(min(end, until) if until is not None else end)
    saves = [s for s in start.saves if s.time >= t_train - 1e-6]
    blocked = min(train, sum(s.blocking_s for s in saves))
    lost_from = _rework_from(start, saves, resumed, t_train, clock.now)
    lost = 0.0
    if lost_from is not None:
        window = max(0.0, clock.now - lost_from)
        lost = window - sum(s.blocking_s for s in saves if s.time >= lost_from)
        lost = max(0.0, min(lost, train - blocked))
    out.buckets["checkpoint"] += blocked
    out.buckets["rework"] += lost
    out.buckets["productive"] += train - blocked - lost
    # after a finished start's training (trained_until): other; after a fault (fault_at): detection; else nothing
    out.buckets["detection" if start.fault_at is not None else "other"] += clock.to(end)


def _rework_from(start: Start, saves: Sequence[Save], resumed: int | None, t_train: float,
                 t_end: float) -> float | None:
    """When this start began training what a later start trained again (None: nothing was)."""
    if resumed is None or start.ended in ("finished", "running"):
        return None
    if start.ended == "stopped" and start.end_step is not None and resumed >= start.end_step:
        return None  # stopped at a checkpoint of its last step (a killed start's newest record is a lower bound)
    at = [s for s in saves if s.step == resumed]
    if at:
        return at[-1].time + at[-1].blocking_s
    if start.start_step is not None and resumed <= start.start_step:
        return t_train
    if start.end_step is not None and start.start_step is not None and start.end_step > start.start_step:
        kept = (resumed - start.start_step) / (start.end_step - start.start_step)
        return t_train + kept * (t_end - t_train)  # no save record of that step: by steps, evenly
    return None


def _gap(out: Goodput, t_from: float, t_to: float, allocations: Sequence[AllocationTimes]) -> None:
    """Between one start's last record and the next start's begin: Slurm's requeue hold and the queue, where its
    accounting says so (the later allocation's eligible and start times), the rest recovery."""
    gap = max(0.0, t_to - t_from)
    before = [a for a in allocations if a.end is not None and a.end <= t_to and (a.start or 0) <= t_from]
    after = [a for a in allocations if a.start is not None and t_from < a.start <= t_to + 1]
    hold = wait = 0.0
    if before and after:
        ended, nxt = max(a.end or 0.0 for a in before), min(after, key=lambda a: a.start or 0.0)
        eligible = nxt.eligible if nxt.eligible is not None else ended
        hold = min(gap, max(0.0, eligible - ended))
        wait = min(gap - hold, max(0.0, (nxt.start or 0.0) - max(eligible, ended)))
    out.buckets["requeue_hold"] += hold
    out.holds += hold > 0
    out.buckets["queue"] += wait
    out.buckets["recovery"] += gap - hold - wait


def total(parts: Sequence[Goodput], name: str) -> Goodput:
    """A sweep's (or a run folder's several jobs') total: each bucket and GPU-hours summed, ETTR of the sums."""
    out = Goodput(name, 0)
    for p in parts:
        out.add(p)
    return out
