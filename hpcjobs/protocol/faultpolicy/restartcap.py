"""The restart cap (the profile's `preemption.max_restarts`): how many requeues in a row a job may have after which
it committed no newer checkpoint. A job that advances between its stops (a long run in time-limit chunks: two
weeks on a 24-hour limit is 14 chunks) is requeued as often as it needs; one that keeps being stopped without
progress ends failed, with one line naming the cause that repeats. The in-allocation recovery's cap counts its
recoveries the same way (hpcjobs.protocol.faultpolicy.recoverable).

Progress is the newest committed checkpoint's step, as the node reads it for any entry: RUN/checkpoints/step-N (the
shared trainer, and a script saving with trainers.checkpoint) and RUN/script-checkpoint.json (the step a user's HF
Trainer, Lightning or accelerate loop last completed under hpcjobs's marks, trainers/integrations/marks.py). A
script that saves only on its own shows none: each of its requeues counts, as every requeue did before.

The row is RUN/requeues.json, rewritten whole (atomically): the job, and each requeue of the row with the scheduler's
count it leads to, the progress it left and why the start before it stopped. A stop that requeues adds its requeue
(trainers.preemption.finish_stop, trainers.standby); a start after a requeue no stop made (the scheduler's own, an
in-allocation recovery's, an outside `scontrol requeue`) adds that one (trainers.launch). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hpcjobs.protocol.runfolder import RunFolder, write_json_atomic

NONE = -1
"""The progress of a run folder without a committed checkpoint."""
OUTSIDE = "a requeue no stop of the job asked for: the scheduler's, a recovery's or an outside scontrol requeue"
"""The cause of a requeue that a start finds unrecorded."""
UNSEEN = "a stop (no run folder to see progress in)"
"""The cause of every requeue of a job without a run folder: each one counts."""


@dataclass(frozen=True)
class Requeue:
    requeue: int
    """The scheduler's requeue count of the start it begins (Slurm's SLURM_RESTART_COUNT there)."""
    step: int
    """The newest committed checkpoint's step when it was made (NONE: none)."""
    cause: str
    """Why the start before it stopped (restarts.jsonl's `stopped` word, or OUTSIDE)."""


def progress(run: RunFolder | None) -> int:
    """The newest committed checkpoint's step the run folder shows, whoever wrote it (NONE: none)."""
    if run is None:
        return NONE
    steps = [run.newest_checkpoint()]
    record = run.read("script_checkpoint")
    if isinstance(record, dict) and type(record.get("step")) is int:
        steps.append(record["step"])
    return max((s for s in steps if s is not None), default=NONE)


def recorded(run: RunFolder, job_id: str) -> list[Requeue]:
    """The row RUN/requeues.json holds for `job_id`, oldest first (a row of another job, or a file that cannot be
    read, holds none: a new job with the same run folder starts its own count)."""
    data = run.read("requeue_row")
    if not isinstance(data, dict) or data.get("job_id") != job_id or not isinstance(data.get("row"), list):
        return []
    row = []
    for r in data["row"]:
        if isinstance(r, dict) and type(r.get("requeue")) is int and type(r.get("step")) is int:
            row.append(Requeue(r["requeue"], r["step"], str(r.get("cause", "?"))))
    return row


def trailing(row: Sequence[Requeue], step: int) -> list[Requeue]:
    """The requeues at the end of `row` after which no checkpoint newer than `step` was committed, oldest first."""
    out: list[Requeue] = []
    for r in reversed(row):
        if r.step != step:
            break
        out.append(r)
    return out[::-1]


def fruitless(run: RunFolder | None, job_id: str, requeues: int, step: int) -> list[Requeue]:
    """At a stop of the start the scheduler's `requeues`-th requeue began, with `step` committed: the requeues in a
    row that brought no newer checkpoint, this start's own among them. The same on every rank, whether or not rank 0
    has recorded this stop's requeue yet (it leads to a count above `requeues`). Without a run folder every requeue
    counts."""
    if run is None:
        return [Requeue(n, NONE, UNSEEN) for n in range(1, requeues + 1)]
    return trailing([r for r in recorded(run, job_id) if r.requeue <= requeues], step)


def record(run: RunFolder, job_id: str, *requeues: Requeue) -> None:
    """Add `requeues` to the job's row (rank 0), dropping those before the newest progress."""
    row = [*(r for r in recorded(run, job_id) if r.requeue < requeues[0].requeue), *requeues]
    keep = trailing(row, row[-1].step)
    write_json_atomic(run.requeue_row, {"job_id": job_id, "row": [asdict(r) for r in keep]})


def at_start(run: RunFolder, job_id: str, requeues: int, write: bool) -> list[Requeue]:
    """At the start the scheduler's `requeues`-th requeue began: the requeues in a row since the newest committed
    checkpoint, this start's last (the start is refused when those before it reach the cap: `reached`). Requeues
    no stop recorded (the scheduler's own, a recovery's, an outside `scontrol requeue`; or made before the run folder
    kept a row) are taken as made now, at the present progress; `write` (rank 0) records them."""
    if requeues <= 0:
        return []
    step, row = progress(run), [r for r in recorded(run, job_id) if r.requeue <= requeues]
    if not row or row[-1].requeue < requeues:
        missing = [Requeue(n, step, OUTSIDE) for n in range(row[-1].requeue + 1 if row else 1, requeues + 1)]
        row += missing
        if write:
            record(run, job_id, *missing)
    return trailing(row, step)


def reached(row: Sequence[Requeue], cap: int) -> bool:
    """Whether another requeue would pass the cap: `cap` requeues in a row already brought no newer checkpoint."""
    return len(row) >= cap


def line(cap: int, row: Sequence[Requeue], step: int, now: str) -> str:
    """The failed job's one line: the cap, why this start stopped (`now`), and the cause that repeats."""
    if cap == 0:
        return f"restart cap 0 reached ({now}): max_restarts 0 never requeues the job"
    at = f"step {step}" if step >= 0 else "the beginning (none committed yet)"
    causes = ", ".join(dict.fromkeys([*(r.cause for r in row), now]))
    return (f"restart cap {cap} reached ({now}): {len(row)} requeue{'s' if len(row) != 1 else ''} in a row brought "
            f"no checkpoint newer than {at}; stopped each time by: {causes}")
