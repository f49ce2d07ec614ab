"""`hpcjobs goodput ID|RUN_FOLDER [--json]`: each job's (a sweep: each task's) buckets, their total, and advice.

A job id reads its run folder's records of that job (an array id: every task's); a run folder reads every job that
ran on it (a run resumed by a second submit is two jobs). The job store gives each job's submit time and GPUs, the
scheduler its allocations (Slurm: sacct, where accounting answers; local: the launcher's allocations.jsonl)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcjobs.backends import backend_for
from hpcjobs.goodput.advice import advice, step_time
from hpcjobs.goodput.buckets import BUCKETS, STARTUP_PARTS, AllocationTimes, Goodput, Start, compute, total
from hpcjobs.goodput.incidents import Incident, incidents
from hpcjobs.goodput.records import allocations, job_ids, job_times, read_starts, resumed_after
from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.profiles.slurmtime import parse_time
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.runfolder import FIRST_STEP, RunFolder, read_jsonl
from hpcjobs.protocol.states import JobState

RUNNING = frozenset({JobState.RUNNING, JobState.COMPLETING, JobState.CONFIGURING, JobState.SIGNALING})
WAITING = frozenset({JobState.PENDING, JobState.REQUEUED, JobState.REQUEUE_HOLD, JobState.REQUEUE_FED,
                     JobState.SUSPENDED})
"""A job with starts in these states has not ended but trains nowhere: a requeued job back in the queue (a local
job STOPPED at a checkpoint has ended: it is resumed by a new job, so it is not here)."""
BUCKET_WORDS = {"queue": "queue wait", "startup": "start-up", "productive": "productive training",
                "checkpoint": "checkpoint blocking", "rework": "rework (steps done again)",
                "detection": "fault detection (a hang noticed)",
                "requeue_hold": "requeue hold (Slurm)", "recovery": "recovery (between starts)",
                "other": "other (after the last record)"}


@dataclass
class Report:
    name: str
    parts: list[Goodput] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    faults: list[Incident] = field(default_factory=list)

    @property
    def total(self) -> Goodput:
        return total(self.parts, self.name) if len(self.parts) != 1 else self.parts[0]

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.name, "jobs": [p.as_dict() for p in self.parts], "total": self.total.as_dict(),
                "faults": [f.as_dict() for f in self.faults], "advice": self.advice}


# --- one run folder ------------------------------------------------------------------------------------------------

def gpus_of(run: RunFolder, rec: JobRecord | None) -> int:
    if rec is not None:
        return rec.nodes * rec.gpus_per_node
    spec = run.read("spec") or {}
    try:
        return int(spec.get("nodes", 1)) * int(spec.get("gpus_per_node", 1))
    except (TypeError, ValueError):
        return 1


StateOf = Callable[[JobRecord], "JobState | None"]


def scheduler_state(rec: JobRecord) -> JobState:
    from hpcjobs.follow.status import status_of

    return status_of(rec).state


def folder_report(run: RunFolder, record: JobRecord | None, store: JobStore, now: float,
                  runner: Callable[[Sequence[str]], Any] | None = None, state_of: StateOf = scheduler_state,
                  ) -> tuple[list[Goodput], list[Start], list[Incident]]:
    """Each job on the run folder (with `record`: only that job's): its Goodput, the starts it read, and its faults
    (the start that resumed one may be another job's: all the folder's starts are read).
    `state_of`: the job's state (whether it still runs), by default status_of's."""
    starts = read_starts(run)
    jobs = jobs_of(run, record, store)
    resumed = resumed_after([s for _, s in starts], run.newest_checkpoint())
    out: list[Goodput] = []
    mine: list[Start] = []
    for job, rec in jobs:
        state = state_of(rec) if rec is not None else None
        running, waiting = state in RUNNING, state is not None and state in WAITING
        allocs = allocations(run, job)
        if rec is not None:  # what the scheduler recorded (Slurm's accounting) over the run folder's own record
            allocs = [AllocationTimes(start, end, eligible) for eligible, start, end in
                      backend_for(rec.scheduler).allocations(rec, runner) if start is not None] or allocs
        times = job_times(starts, job, gpus_of(run, rec), rec.submitted if rec else None, allocs, running,
                          waiting, run.startup.exists())
        g = compute(times, [r for (j, _), r in zip(starts, resumed, strict=True) if j == job], now)
        g.job_id = rec.job_id if rec is not None else job
        out.append(g)
        mine += times.starts
    chosen = {j for j, _ in jobs}
    return out, mine, [f for f in incidents(starts) if f.job_id in chosen]


def jobs_of(run: RunFolder, record: JobRecord | None, store: JobStore) -> list[tuple[str, JobRecord | None]]:
    """The run folder's jobs as its ranks name them, each with its job record. With `record`, that job alone; an
    array task's ranks name its own Slurm id (SLURM_JOB_ID), not the `ID_N` the store knows, and its run folder is
    its own: every job in it is the task's."""
    ids = job_ids(run)
    if record is not None:
        return [(record.job_id, record)] if record.job_id in ids else [(j, record) for j in ids]
    return [(j, store.get(j) if store.path.exists() else None) for j in ids]


def run_step_time(run: RunFolder) -> float | None:
    records = read_jsonl(run.metrics, {"time": (int, float), "step": (int,), "restart": (int,)})
    return step_time([(r.get("restart", 0), r["step"], r["time"]) for r in records
                      if "loss" in r and isinstance(r.get("step"), int) and isinstance(r.get("time"), (int, float))])


def seconds_before_of(run: RunFolder) -> int | None:
    spec = run.read("spec") or {}
    value = (spec.get("preemption") or {}).get("seconds_before") if isinstance(spec, dict) else None
    return value if isinstance(value, int) else None


def time_limit_of(run: RunFolder) -> int | None:
    """The time limit the run folder's newest submission asked for (spec.json's `time`); None without one."""
    spec = run.read("spec") or {}
    text = spec.get("time") if isinstance(spec, dict) else None
    try:
        return parse_time(text) if isinstance(text, str) and text else None
    except UsageError:
        return None


def report(target: str, store: JobStore | None = None, now: float | None = None,
           runner: Callable[[Sequence[str]], Any] | None = None, state_of: StateOf = scheduler_state) -> Report:
    """The report of a run folder, a job, or a sweep's array (one part per task). `runner` runs sacct, `state_of`
    tells whether a job still runs (tests pass stand-ins)."""
    from hpcjobs.follow.status import records_for

    store = store or JobStore()
    now = time.time() if now is None else now
    if target.strip() and Path(target).is_dir():
        folders: list[tuple[RunFolder, JobRecord | None]] = [(RunFolder(target), None)]
    elif not target.strip() or "/" in target or Path(target).exists():
        why = "is a file" if Path(target).exists() and target.strip() else "is no such folder"
        raise UsageError(f"{target!r} {why}: neither a run folder nor a job id.",
                         "give a run folder (RUN/ holds restarts.jsonl) or a job id from `hpcjobs list`.")
    else:
        folders = [(RunFolder(r.run_dir), r) for r in records_for(target, store)]
    out = Report(target)
    for run, job in folders:
        parts, starts, faults = folder_report(run, job, store, now, runner, state_of)
        out.parts += parts
        out.faults += faults if len(folders) == 1 else []
        if len(folders) == 1 and len(parts) >= 1:
            out.advice = advice(total(parts, target), starts, run_step_time(run), seconds_before_of(run),
                                time_limit_of(run))
    return out


# --- text ----------------------------------------------------------------------------------------------------------

def seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.2f} h"


def ettr_text(g: Goodput) -> str:
    return "-" if g.ettr is None else f"{g.ettr:.1%}"


UNTOLD = "the script reports no steps (a plain script), so its training is not told apart from its start-up"
"""Why a job's productive time and ETTR are unknown (no start-up marks: hpcjobs.goodput.buckets.JobTimes)."""


def status_line(g: Goodput) -> str:
    """`hpcjobs status`'s goodput line."""
    productive = f"{seconds(g.buckets['productive'])} productive" if g.known else "productive time unknown"
    return (f"ETTR {ettr_text(g)}: {productive} of {seconds(g.allocated_s)} allocated (wall {seconds(g.wall_s)}); "
            f"hpcjobs goodput {g.job_id}")


def table_lines(g: Goodput) -> list[str]:
    hours = g.gpu_hours()
    lines = [f"{'bucket':32} {'seconds':>10} {'share':>7} {'GPU-h':>9}"]
    for b in BUCKETS:
        share = g.buckets[b] / g.wall_s if g.wall_s else 0.0
        if not g.known and b in ("startup", "productive"):  # honest rows: not 0 s of training (issue 37)
            lines.append(f"{'start-up and training':32} {g.buckets[b]:10.2f} {share:7.1%} {hours[b]:9.4f}"
                         if b == "startup" else f"{BUCKET_WORDS[b]:32} {'unknown':>10}")
            continue
        lines.append(f"{BUCKET_WORDS[b]:32} {g.buckets[b]:10.2f} {share:7.1%} {hours[b]:9.4f}")
        if b == "startup":
            lines += [f"  {p:30} {g.startup_parts[p]:10.2f}" for p in STARTUP_PARTS]
    lines.append(f"{'sum (= wall time)':32} {sum(g.buckets.values()):10.2f} {1:7.0%} {sum(hours.values()):9.4f}")
    return lines


def text(rep: Report) -> str:
    g = rep.total
    head = (f"goodput of {rep.name}: wall {seconds(g.wall_s)}, allocated {seconds(g.allocated_s)}, ETTR "
            f"{ettr_text(g)} (productive / allocated); {g.starts} start(s), {g.interruptions} interrupted")
    lines = [head]
    if len(rep.parts) > 1:
        lines.append(f"{'job':32} {'wall s':>9} {'ETTR':>7} " + " ".join(f"{b[:9]:>9}" for b in BUCKETS))
        lines += [f"{p.job_id:32} {p.wall_s:9.1f} {ettr_text(p):>7} " + " ".join(f"{p.buckets[b]:9.1f}"
                                                                                  for b in BUCKETS) for p in rep.parts]
        lines.append("total:")
    lines += table_lines(g)
    lines += [] if g.known else [f"note: {UNTOLD}"]
    lines += [f"fault: {f.line()}" for f in rep.faults]
    lines += [f"advice: {a}" for a in rep.advice]
    return "\n".join(lines)


def job_goodput(rec: JobRecord, state: JobState | None, store: JobStore | None = None) -> Goodput | None:
    """One job's Goodput for `status` and `compare` (its state already known: the scheduler is not asked again);
    None before any start. Never raises for what a run folder holds: a line of status must not cost the status."""
    try:
        parts, _, _ = folder_report(RunFolder(rec.run_dir), rec, store or JobStore(), time.time(), None,
                                 lambda _: state)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return parts[0] if parts else None


def folder_goodput(run: RunFolder, newest: JobRecord | None = None, state: JobState | None = None) -> list[Goodput]:
    """Every job of a run folder (compare's rows: a resumed run is several jobs). Only the newest job may still
    run: its state is `state`, the others' are not asked."""
    def state_of(rec: JobRecord) -> JobState | None:
        return state if newest is not None and rec.job_id == newest.job_id else None

    try:
        return folder_report(run, None, JobStore(), time.time(), None, state_of)[0]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def run(target: str, as_json: bool) -> int:
    rep = report(target)
    if not rep.parts:
        raise UsageError(f"{target}: no start of it is recorded yet (pending, or not a run folder of hpcjobs).",
                         "`hpcjobs status ID` says where the job is.")
    print(json.dumps(rep.as_dict(), indent=2) if as_json else text(rep))
    return 0


# --- the timeline (--plot) -------------------------------------------------------------------------------------------

ENDED_MARKS = {"failed": ("x", "failed"), "lost": ("x", "killed (no word)"), "stopped": ("s", "stopped when asked"),
               "refused": ("D", "refused at start"),
               "finished": ("o", "finished")}
"""How a start ended, as a marker at its bar's end."""


def timeline_starts(target: str, store: JobStore | None = None) -> list[tuple[str, Start, int | None]]:
    """Every start of the target's run folders, in order, with its job id and the step the start after it resumed
    at (what `resumed_after` gives the buckets)."""
    from hpcjobs.follow.status import records_for

    folders = [RunFolder(target)] if target.strip() and Path(target).is_dir() else \
        [RunFolder(d) for d in dict.fromkeys(r.run_dir for r in records_for(target, store or JobStore()))]
    out: list[tuple[str, Start, int | None]] = []
    for run in folders:
        starts = read_starts(run)
        resumed = resumed_after([s for _, s in starts], run.newest_checkpoint())
        out += [(job, s, r) for (job, s), r in zip(starts, resumed, strict=True)]
    return out


def timeline(target: str) -> Any:
    """`hpcjobs goodput --plot FILE`'s figure (hpcjobs/cli/runs.py writes it): one bar per start along the wall
    clock, from its begin to its last record: start-up until its first step, then training, its saves where the loop
    waited for them, the training a later start did again hatched (rework), and how it ended marked (✕ failed or
    killed, ■ stopped when asked, ● finished). The gaps between bars are queue, requeue hold and recovery."""
    starts = timeline_starts(target)
    if not starts:
        raise UsageError(f"{target}: no start of it is recorded yet (pending, or not a run folder of hpcjobs).",
                         "`hpcjobs status ID` says where the job is.")
    from matplotlib.figure import Figure

    t0 = min(s.begin for _, s, _ in starts)
    fig = Figure(figsize=(9, 1.5 + 0.45 * len(starts)), layout="constrained")
    ax = fig.add_subplot()
    colors = {b: f"C{i}" for i, b in enumerate(BUCKETS)}  # as compare --plot's goodput bars
    for y, (_, s, resumed) in enumerate(starts):
        end = s.end if s.end is not None else time.time()
        first = s.marks.get(FIRST_STEP, end)
        ax.broken_barh([(s.begin - t0, max(0.0, first - s.begin))], (y - 0.35, 0.7), color=colors["startup"])
        trained = min(end, s.fault_at) if s.fault_at is not None else end  # then the hang's wait to be noticed
        ax.broken_barh([(first - t0, max(0.0, trained - first))], (y - 0.35, 0.7), color=colors["productive"])
        ax.broken_barh([(trained - t0, end - trained)], (y - 0.35, 0.7), color=colors["detection"])
        ax.broken_barh([(v.time - t0, v.blocking_s) for v in s.saves], (y - 0.35, 0.7), color=colors["checkpoint"])
        redo = next((v.time + v.blocking_s for v in s.saves if v.step == resumed), None) if resumed else None
        if redo is None and s.ended in ("failed", "lost") and resumed is not None:
            redo = first  # nothing it saved was resumed: all its training was done again
        if redo is not None and redo < trained:
            ax.broken_barh([(redo - t0, trained - redo)], (y - 0.35, 0.7), facecolor="none", hatch="///",
                           edgecolor=colors["rework"])
        marker, _ = ENDED_MARKS.get(s.ended, ("", ""))
        if marker:
            ax.plot([end - t0], [y], marker, color="black", markersize=7)
    ax.set_yticks(range(len(starts)), [f"{job} #{s.restart}" for job, s, _ in starts], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first start began")
    from matplotlib.patches import Patch

    legend = [Patch(color=colors[b], label=BUCKET_WORDS[b]) for b in ("startup", "productive", "checkpoint",
                                                                        "detection")]
    legend.append(Patch(facecolor="none", edgecolor=colors["rework"], hatch="///", label=BUCKET_WORDS["rework"]))
    fig.legend(handles=legend, fontsize="x-small", ncols=4, loc="outside lower center")
    ax.set_title("ends: x failed or killed, square stopped when asked, circle finished", fontsize="small")
    return fig
