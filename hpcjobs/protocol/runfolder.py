"""The run folder: one per job on a shared filesystem. Both sides use these names; nothing here imports torch.

RUN/checkpoints/step-N/   finished checkpoints only (FINISHED marker written before the atomic rename)
RUN/metrics.jsonl         rank 0, one line per logging interval (loss) and per evaluation (val_loss)
RUN/heartbeat.json        last step and time, rewritten atomically (status without sacct)
RUN/restarts.jsonl        one line per (re)start: when, restart count, why the previous one stopped
RUN/startup.jsonl         one line per rank and start: launched, torch imported, group joined, first step done
RUN/final.json            finished | failed, with the reason
RUN/requeues.json         the job's requeues in a row that brought no newer checkpoint: what the restart cap counts
                          (hpcjobs.protocol.faultpolicy.restartcap)
RUN/failures.jsonl        one line per rank that failed: when, restart, rank, host, error
                          (hpcjobs.protocol.faultpolicy.diagnosis)
RUN/saves.jsonl           rank 0, one line per checkpoint save: job, restart, step, when it began, how long the
                          training loop waited for it (hpcjobs.goodput.buckets's checkpoint cost)
RUN/allocations.jsonl     the local backend, one line per job it ran: when its ranks were started and the last ended
RUN/local-process.json    a local job's launching process (pid, host), so status and cancel can reach it
RUN/tracker.json          rank 0: the experiment trackers' run ids (wandb, mlflow), so a requeued or resumed start
                          logs into the same tracker run; also each one's last logged step per metric
RUN/stop-asked.json       a local job: what the user did to stop it (Ctrl-C, SIGTERM, hpcjobs cancel), for rank 0's line
RUN/joined.json           a local job: whether the script takes part in the stop protocol now, for the launcher's line
RUN/ddp-buckets.json      rank 0: DDP's gradient bucket layout once DDP rebuilt it, so every later start reduces its
                          first step's gradients as the uninterrupted run does (trainers/ddp_buckets.py)
RUN/logs/restart-N/rank-R.log   per rank and per restart; nothing is ever overwritten
RUN/stacks/restart-N/rank-R.txt every thread's Python stack of a rank whose hang watchdog fired (trainers/watchdog.py)

A restart's number N counts every start of the job: a requeue's, and a recovery's inside the allocation
(trainers/recover.py gives each its number before its ranks start, in $HPCJOBS_RESTART).

A run folder given as a pattern (`runs/x-%j`, `sweep-%A/%a`) is resolved by `resolve_run_dir` on every path, once the
job's ids are known; nothing ever creates a folder with a literal `%j` in its name.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcjobs.protocol.atomic import write_atomic
from hpcjobs.protocol.states import FinalState

LAUNCHED, IMPORTED, JOINED, READY, FIRST_STEP = "launched", "imported", "joined", "ready", "first_step"
"""A start's marks, RUN/startup.jsonl's fields (trainers/startup.py writes them): the rank's process launched,
torch and the task imported, the process group joined, the model built and its checkpoint loaded, the first step
done. `hpcjobs goodput` splits a start's start-up at them (hpcjobs.goodput.buckets)."""
STARTUP_MARKS = (LAUNCHED, IMPORTED, JOINED, READY, FIRST_STEP)
"""The marks in the order a start reaches them."""

JOB_ID, ARRAY_ID, TASK_INDEX = "%j", "%A", "%a"
"""The patterns of a run folder, as in Slurm's own file names."""
ARRAY_TASK_DIR = f"{ARRAY_ID}_{TASK_INDEX}"
"""What makes each array task's run folder its own (the array's id, the task's index)."""
RUN_DIR_FIELDS = {
    JOB_ID: ("SLURM_JOB_ID", "HPCJOBS_JOB_ID"),
    ARRAY_ID: ("SLURM_ARRAY_JOB_ID", "HPCJOBS_ARRAY_JOB_ID"),
    TASK_INDEX: ("SLURM_ARRAY_TASK_ID", "HPCJOBS_ARRAY_TASK_ID"),
}
"""The patterns a run folder may hold, as in Slurm's own file names, and the variables (first set wins) that give
them: %j the job id (an array task's own id), %A an array's job id, %a the array task's index (HPCJOBS_*: the
local backend's, which has no Slurm)."""


def split_task_id(job_id: str) -> tuple[str, int | None]:
    """An array task's id `42_3` as (array id, index); any other id as (itself, None)."""
    array, sep, index = job_id.rpartition("_")
    return (array, int(index)) if sep and index.isdigit() else (job_id, None)


def array_ids(job_id: str) -> dict[str, str]:
    """The ids a run folder pattern is resolved with, from a job id as the login node knows it: `42`, or an array
    task's `42_3` (its own numeric id is known only on the node, so an array's folders never use %j)."""
    array, index = split_task_id(job_id)
    if index is not None:
        return {"SLURM_ARRAY_JOB_ID": array, "SLURM_ARRAY_TASK_ID": str(index), "HPCJOBS_JOB_ID": job_id}
    return {"SLURM_JOB_ID": job_id, "HPCJOBS_JOB_ID": job_id}


_FIELD = re.compile("|".join(RUN_DIR_FIELDS))


class RunDirPatternError(ValueError):
    """A run-folder pattern whose ids this job does not have (e.g. %a outside a job array)."""


def has_pattern(path: str) -> bool:
    return bool(_FIELD.search(path))


def fixed_part(pattern: str) -> Path:
    """The longest leading folder of a run-folder pattern that holds no pattern (the pattern itself if none)."""
    fixed = Path(pattern)
    while has_pattern(str(fixed)):
        fixed = fixed.parent
    return fixed


def resolve_run_dir(pattern: str, ids: Mapping[str, str]) -> str:
    """`pattern` with %j, %A and %a replaced from `ids` (an environment, or {"SLURM_JOB_ID": "42"})."""
    def value(m: re.Match[str]) -> str:
        for var in RUN_DIR_FIELDS[m.group(0)]:
            if ids.get(var):
                return ids[var]
        raise RunDirPatternError(f"run folder {pattern!r} holds {m.group(0)}, but this job has no "
                                 f"{' or '.join(RUN_DIR_FIELDS[m.group(0)])}")
    return _FIELD.sub(value, pattern)


CHECKPOINT_DIR = re.compile(r"^step-(\d+)$")
"""A checkpoint's folder in RUN/checkpoints/: finished by the protocol once it has this name (renamed when whole)."""


class RunFolder:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    checkpoints = property(lambda self: self.path / "checkpoints")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    heartbeat = property(lambda self: self.path / "heartbeat.json")
    restarts = property(lambda self: self.path / "restarts.jsonl")
    requeue_row = property(lambda self: self.path / "requeues.json")  # hpcjobs.protocol.faultpolicy.restartcap
    startup = property(lambda self: self.path / "startup.jsonl")
    final = property(lambda self: self.path / "final.json")
    failures = property(lambda self: self.path / "failures.jsonl")
    saves = property(lambda self: self.path / "saves.jsonl")  # trainers.checkpoint.saves: each save's blocking time
    allocations = property(lambda self: self.path / "allocations.jsonl")  # the local backend: job start and end
    spec = property(lambda self: self.path / "spec.json")
    logs = property(lambda self: self.path / "logs")
    local_process = property(lambda self: self.path / "local-process.json")  # who runs a local job: pid, host
    tracker = property(lambda self: self.path / "tracker.json")  # trainers.tracking: tracker run ids, logged steps
    script_checkpoint = property(lambda self: self.path / "script-checkpoint.json")  # trainers.integrations: the
    # newest complete checkpoint a user's Trainer wrote, {"path", "step"}, found again by a start whose output folder
    # has another name
    nccl_traces = property(lambda self: self.path / "nccl-trace")  # NCCL flight recorder dumps, rank-R each
    stop_asked = property(lambda self: self.path / "stop-asked.json")  # hpcjobs.protocol.userstop: what the user did
    joined = property(lambda self: self.path / "joined.json")  # hpcjobs.protocol.userstop: the script in the protocol
    ddp_buckets = property(lambda self: self.path / "ddp-buckets.json")  # trainers.ddp_buckets: DDP's bucket layout
    lock = property(lambda self: self.path / ".lock")  # flock of the running job's rank 0; holds who holds it

    def rank_log(self, restart: int, rank: int) -> Path:
        return self.logs / f"restart-{restart}" / f"rank-{rank}.log"

    def newest_checkpoint(self) -> int | None:
        """The newest finished checkpoint's step (None: none, or the folder cannot be read)."""
        try:
            steps = [int(m.group(1)) for p in self.checkpoints.iterdir() if (m := CHECKPOINT_DIR.match(p.name))]
        except OSError:
            return None
        return max(steps, default=None)

    def next_restart(self) -> int:
        """The number the next start of the job gets: one past every start the folder has seen (a requeue's, a
        recovery's, a local resume's), so no two starts share their logs and records."""
        starts = [r.get("restart", 0) for r in self.read_restarts()]
        return max([*starts, *self.restart_dirs()]) + 1 if starts or self.restart_dirs() else 0

    def stack_file(self, restart: int, rank: int) -> Path:
        return self.path / "stacks" / f"restart-{restart}" / f"rank-{rank}.txt"

    def restart_dirs(self) -> list[int]:
        if not self.logs.is_dir():
            return []
        return sorted(int(p.name.split("-", 1)[1]) for p in self.logs.glob("restart-*") if p.name[8:].isdigit())

    # --- markers -----------------------------------------------------------------------------------------------

    def write_heartbeat(self, step: int, **extra: Any) -> None:
        write_json_atomic(self.heartbeat, {"step": step, "time": time.time(), **extra})

    def record_start(self, restart: int, job_id: str, world_size: int, **extra: Any) -> None:
        append_jsonl(self.restarts, {"time": time.time(), "restart": restart, "job_id": job_id,
                                     "world_size": world_size, **extra})

    def record_stop(self, reason: str, step: int, restart: int, **extra: Any) -> None:
        """Why this (re)start ended without finishing: preemption, timeout, interrupt, cap, fault (a recovery: its
        `recovery` field is how many the job has had, `cause` the failure it recovers from, `how` in the allocation
        or by a requeue, `exclude` the nodes left out)."""
        append_jsonl(self.restarts, {"time": time.time(), "restart": restart, "stopped": reason, "step": step,
                                     **extra})

    def write_final(self, state: FinalState, reason: str, step: int | None = None, job_id: str | None = None,
                    ) -> None:
        """`job_id`: the job that ended (two jobs may share a run folder one after the other). final.json is the
        run's last word; finals/JOB.json keeps each job's own, which the next job's final.json replaces (a finished
        run started again with the same --run-dir: the first job still ended COMPLETED)."""
        final = {"state": str(state), "reason": reason, "step": step, "time": time.time(), "job_id": job_id}
        if job_id and re.fullmatch(r"[\w.-]+", job_id):
            write_json_atomic(self.path / "finals" / f"{job_id}.json", final)
        write_json_atomic(self.final, final)

    def final_of(self, job_id: str) -> Any:
        """The final word `job_id` wrote: final.json if it is that job's (or names none), else finals/JOB.json."""
        final = self.read("final")
        if isinstance(final, dict) and final.get("job_id") in (None, job_id):
            return final
        return read_json(self.path / "finals" / f"{job_id}.json") if re.fullmatch(r"[\w.-]+", job_id) else None

    def read(self, which: str) -> Any:
        return read_json(getattr(self, which))

    def read_restarts(self) -> list[dict[str, Any]]:
        return read_jsonl(self.restarts, RESTART_FIELDS)

    def read_failures(self) -> list[dict[str, Any]]:
        return read_jsonl(self.failures, FAILURE_FIELDS)


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(obj, sort_keys=True))


def append_jsonl(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(obj, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write of a whole line: concurrent appenders never interleave within a line
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


_NUMBER = (int, float)
RESTART_FIELDS: Mapping[str, tuple[type, ...]] = {
    "restart": (int,), "time": _NUMBER, "world_size": (int,), "step": (int, type(None)), "stopped": (str,)}
"""restarts.jsonl's fields that its readers compare or count, with the types the launcher writes them as."""
FAILURE_FIELDS: Mapping[str, tuple[type, ...]] = {"restart": (int,), "rank": (int,), "time": _NUMBER}
"""failures.jsonl's, likewise."""


def _fits(record: Any, fields: Mapping[str, tuple[type, ...]]) -> bool:
    return isinstance(record, dict) and all(
        k not in record or (isinstance(record[k], types) and not isinstance(record[k], bool))
        for k, types in fields.items())


def read_jsonl(path: Path, fields: Mapping[str, tuple[type, ...]] | None = None) -> list[dict[str, Any]]:
    """The file's JSON objects, one per line. A line that is not one (the torn last line of a killed writer, a line
    written by hand) or whose `fields` have other types than the writer gives them is skipped: its readers compare
    and count those fields, and a status must answer whatever the folder holds."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if _fits(record, fields or {}):
            out.append(record)
    return out


def lines_of(history: list[dict[str, Any]], job_id: str) -> list[dict[str, Any]]:
    """The job's own lines of a run folder's restarts.jsonl: its start lines, each with the stop lines after it (a
    stop line names no job: it is the start's before it). Another job on the same folder has its own. A folder with
    no start line at all (written before starts were recorded) is taken as the job's."""
    if all("stopped" in r for r in history):
        return list(history)
    mine, own = [], False
    for r in history:
        if "stopped" not in r:
            own = str(r.get("job_id")) == job_id
        if own:
            mine.append(r)
    return mine
