"""Where a rank's start-up time goes: when its process was launched, imported torch, joined the process group and
finished its first step. One line per rank and start in RUN/startup.jsonl (wall-clock seconds, comparable across
nodes that keep their clocks in sync), written once the first step is done, so start-up never waits on it.
bench/startup.py reads it to split submit → first step into its stages."""

from __future__ import annotations

import os
import time
from typing import Any

from hpcjobs.protocol.runfolder import LAUNCHED, RunFolder, append_jsonl
from trainers import watchdog
from trainers.distenv import DistEnv

_marks: dict[str, float] = {}
_cpu: dict[str, float] = {}


def mark(name: str) -> None:
    """Note that `name` (one of hpcjobs.protocol.runfolder.STARTUP_MARKS) happened now, and the CPU time this
    process had used by then; the first time counts (a stage is reached once per process)."""
    if name not in _marks:
        _marks[name] = time.time()
        _cpu[name] = round(time.process_time(), 3)
        watchdog.alive()  # a stage of start-up done: the hang watchdog's start-up bound starts again


def again(now: float) -> None:
    """A rank that kept its process through a replacement (trainers.rejoin) starts again now: its stages are
    marked anew, from here."""
    _marks.clear()
    _cpu.clear()
    _again.append(now)


_again: list[float] = []
"""When this process started again in place, if it did (the newest last): its start's beginning."""


def process_started() -> float | None:
    """When this process was started (exec'd by srun or the launcher), from /proc: Linux only, 10 ms resolution."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def launched_at() -> float:
    """The earliest moment this rank's start is known to have existed: its process's start, or now where /proc
    cannot say. Where the scheduler states no end (trainers.jobenv's `stated_end`: SLURM_JOB_END_TIME on newer
    Slurm), a rank's time limit counts from here, so what this process did before Python reached hpcjobs (a
    `sitecustomize`, imports from a slow filesystem) does not make its own stop late; what happened before the
    process existed (a wrapper that starts it as a child, the job script's own work) still does."""
    now = time.time()
    started = process_started()
    return now if started is None else min(now, started)


def record(run: RunFolder, env: DistEnv, start_step: int | None = None, **extra: Any) -> None:
    """Append this rank's line; `cpu_s` is the CPU time the process used to get here, `cpu_at` the CPU time it had
    used at each mark (on hosts where ranks share cores, start-up wall time grows with the ranks per core; these
    show which stage's own work grows). `start_step`: the step this start began at (the one it resumed from; 0
    fresh), which tells `hpcjobs goodput` which steps the start before it trained in vain; `extra`: more fields
    (`resumed_tier`: trainers.localtier's word for where it resumed from)."""
    append_jsonl(run.startup, {"restart": env.restart, "rank": env.rank, "job_id": env.job_id, "pid": os.getpid(),
                               "host": os.uname().nodename, LAUNCHED: _again[-1] if _again else process_started(),
                               "cpu_s": round(time.process_time(), 3), "cpu_at": dict(_cpu), "start_step": start_step,
                               **_marks, **extra})
