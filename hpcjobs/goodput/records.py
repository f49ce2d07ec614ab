"""The records `hpcjobs goodput` adds up, read from a run folder (hpcjobs.protocol.runfolder's files), as
hpcjobs.goodput.buckets's `Start`s and `JobTimes`. Torch-free; reads only.

Which start a record belongs to: restarts.jsonl's start lines (in file order; a stop line belongs to the start line
before it), startup.jsonl's, saves.jsonl's, failures.jsonl's and final.json's by job id and restart; heartbeat.json
and metrics.jsonl carry only the restart, so they count where their time falls between the start's begin and the
next start's (two jobs on one run folder both have a restart 0). A start its ranks refused (the last line of rank
0's log a refusal, exit code 2) ended "refused": not a fault, not interrupted work."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hpcjobs.follow.refused import rank_line
from hpcjobs.goodput.buckets import MARKS, AllocationTimes, JobTimes, Save, Start
from hpcjobs.protocol.faultpolicy.recoverable import REFUSED_EXIT
from hpcjobs.protocol.runfolder import FIRST_STEP, LAUNCHED, RunFolder, read_jsonl
from hpcjobs.protocol.states import StopReason

_NUM = (int, float)
STARTUP_FIELDS = {"restart": (int,), **{m: (*_NUM, type(None)) for m in MARKS}}
SAVE_FIELDS = {"restart": (int,), "step": (int,), "time": _NUM, "blocking_s": _NUM}
ALLOCATION_FIELDS = {"start": _NUM, "end": _NUM}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, _NUM) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def job_ids(run: RunFolder) -> list[str]:
    """The jobs that started on this run folder, in the order of their first start."""
    seen: dict[str, None] = {}
    for r in run.read_restarts():
        if "stopped" not in r and r.get("job_id") is not None:
            seen.setdefault(str(r["job_id"]), None)
    return list(seen)


def start_lines(run: RunFolder) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each start line of restarts.jsonl with its stop line (None when it did not stop at a checkpoint)."""
    out: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for r in run.read_restarts():
        if "stopped" not in r:
            if isinstance(r.get("time"), _NUM):
                out.append((r, None))
        elif r["stopped"] == str(StopReason.FAULT):
            continue  # a recovery's record, not a stop at a checkpoint: the start failed (its ranks' records)
        elif out and out[-1][1] is None and r.get("restart") == out[-1][0].get("restart"):
            out[-1] = (out[-1][0], r)
    return out


def read_starts(run: RunFolder) -> list[tuple[str, Start]]:
    """Every start on the run folder, in order, with its job id."""
    lines = start_lines(run)
    startup = read_jsonl(run.startup, STARTUP_FIELDS)
    saves = read_jsonl(run.saves, SAVE_FIELDS)
    failures = run.read_failures()
    metrics = [m for m in read_jsonl(run.metrics, {"time": _NUM, "step": (int,), "restart": (int,)})
               if isinstance(m.get("time"), _NUM)]
    heartbeat = run.read("heartbeat")
    final = run.read("final")
    out: list[tuple[str, Start]] = []
    for i, (line, stop) in enumerate(lines):
        job, restart, begin = str(line.get("job_id")), int(line.get("restart", 0)), float(line["time"])
        until = float(lines[i + 1][0]["time"]) if i + 1 < len(lines) else float("inf")
        mine = [r for r in startup if str(r.get("job_id")) == job and r.get("restart") == restart]
        marks = _slowest(mine)
        if mine:
            begin = min([begin, *(v for r in mine if (v := _num(r.get(LAUNCHED))) is not None)])
        own_saves = tuple(Save(int(s["step"]), float(s["time"]), max(0.0, float(s["blocking_s"])),
                               s.get("background") is True)
                          for s in saves if str(s.get("job_id")) == job and s.get("restart") == restart)
        tier = next((t for r in mine if isinstance(t := r.get("resumed_tier"), str)), None)
        start = Start(restart, begin, marks, _start_step(mine), saves=own_saves, tier=tier)
        timed = [(float(m["time"]), m.get("step")) for m in metrics
                 if m.get("restart") == restart and begin <= m["time"] < until]
        if isinstance(heartbeat, dict) and heartbeat.get("restart") == restart and _num(heartbeat.get("time")):
            if begin <= float(heartbeat["time"]) < until:
                timed.append((float(heartbeat["time"]), heartbeat.get("step")))
        timed += [(s.time + s.blocking_s, s.step) for s in own_saves]
        timed += [(float(f["time"]), None) for f in failures
                  if str(f.get("job_id")) == job and f.get("restart") == restart and begin <= f["time"] < until]
        start = _ending(start, stop, final if i == len(lines) - 1 or lines[i + 1][0].get("job_id") != job else None,
                        job, timed, any(str(f.get("job_id")) == job and f.get("restart") == restart
                                        for f in failures))
        if start.ended in ("failed", "lost"):
            start = replace(start, fault_at=fault_at(failures, job, restart, start))
        if start.ended == "lost" and refused_start(run, job, restart):
            start = replace(start, ended="refused")  # not a fault: nothing ran (hpcjobs.follow.refused)
        out.append((job, start))
    return out


def fault_at(failures: Sequence[dict[str, Any]], job: str, restart: int, start: Start) -> float | None:
    """When the start's first hung rank last made progress (its watchdog's record: the time less `idle_s`), when
    that lies inside the start's training; None for other faults (a killed rank is noticed at once)."""
    hung = [float(f["time"]) - float(f["idle_s"]) for f in failures
            if str(f.get("job_id")) == job and f.get("restart") == restart and _num(f.get("idle_s")) is not None]
    first_step = start.marks.get(FIRST_STEP)
    at = min(hung, default=None)
    return at if at is not None and first_step is not None and start.end is not None and first_step <= at < start.end \
        else None


def refused_start(run: RunFolder, job: str, restart: int) -> bool:
    """Whether rank 0 of this start logged a refusal as its last line, and the job's exit code (where the local
    backend recorded one) was 2: a refused start, neither a fault nor interrupted work."""
    codes = [a["code"] for a in read_jsonl(run.allocations, {"code": (int,)}) if str(a.get("job_id")) == job]
    return (codes or [REFUSED_EXIT])[-1] == REFUSED_EXIT and rank_line(run, job, restart) is not None


def _slowest(lines: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each mark of the slowest rank (the job moves on when the last rank got there)."""
    marks: dict[str, float] = {}
    for mark in MARKS:
        values = [v for r in lines if (v := _num(r.get(mark))) is not None]
        if values:
            marks[mark] = max(values)
    return marks


def _start_step(lines: Sequence[dict[str, Any]]) -> int | None:
    steps = [step for r in lines if (step := _int(r.get("start_step"))) is not None]
    return min(steps) if steps else None


def _ending(start: Start, stop: dict[str, Any] | None, final: Any, job: str,
            timed: list[tuple[float, Any]], failed: bool) -> Start:
    """Where and how the start ended: its stop line, the job's final.json, else its newest record."""
    if stop is not None:
        return replace(start, end=float(stop["time"]), end_step=_int(stop.get("step")), ended="stopped",
                       stop_to_commit_s=_num(stop.get("signal_to_commit_s")))
    if isinstance(final, dict) and str(final.get("job_id")) == job and _num(final.get("time")):
        state, step, end = "finished" if final.get("state") == "finished" else "failed", _int(final.get("step")), \
            float(final["time"])
        # where training ended: the newest record of its last step (an accelerate script's post-loop imports were
        # 2.4 s of its 3.1 s "productive" when the launcher's final.json ended it)
        last = step if step is not None else max((n for _, s in timed if (n := _int(s)) is not None), default=None)
        trained = [t for t, s in timed if last is not None and _int(s) == last and t <= end]
        until = max(trained) if state == "finished" and trained and FIRST_STEP in start.marks else None
        return replace(start, end=end, end_step=step, ended=state, trained_until=until)
    newest = max(timed, key=lambda t: t[0], default=None)
    steps = [step for _, s in timed if (step := _int(s)) is not None]
    return replace(start, end=max(newest[0], start.begin) if newest else start.begin,
                   end_step=max(steps) if steps else None, ended="failed" if failed else "lost")


def resumed_after(starts: Sequence[Start], newest: int | None) -> list[int | None]:
    """For each start, the step the start after it resumed at; for the last, the newest checkpoint's step (what a
    resume would start from) when it ended without finishing."""
    out: list[int | None] = [nxt.start_step if nxt.start_step is not None else None for nxt in starts[1:]]
    last = starts[-1] if starts else None
    out.append(newest if last is not None and last.ended in ("failed", "lost") else None)
    return out[:len(starts)]


def allocations(run: RunFolder, job_id: str) -> list[AllocationTimes]:
    """The local backend's record of the job's run (start and end of its ranks)."""
    return [AllocationTimes(float(a["start"]), float(a["end"])) for a in read_jsonl(run.allocations, ALLOCATION_FIELDS)
            if str(a.get("job_id")) == job_id]


def _from_allocations(starts: Sequence[Start], allocs: Sequence[AllocationTimes]) -> tuple[Start, ...]:
    """The first start of each allocation begins with it: the job script and srun before the ranks launched are
    start-up too."""
    claimed: set[int] = set()
    out = []
    for start in starts:
        inside = [i for i, a in enumerate(allocs) if a.start is not None and a.start <= start.begin + 1]
        i = max(inside, key=lambda k: allocs[k].start or 0.0, default=None)
        if i is not None and i not in claimed:
            claimed.add(i)
            start = replace(start, begin=allocs[i].start or start.begin)  # /proc's launch time is ±1 s
        out.append(start)
    return tuple(out)


def job_times(starts: Sequence[tuple[str, Start]], job_id: str, gpus: int, submitted: float | None,
              allocs: Sequence[AllocationTimes], running: bool, waiting: bool = False, marks_recorded: bool = True,
              ) -> JobTimes:
    """The job's starts; its end is its last allocation's (None when unknown: then its last record). `running`:
    its last start runs now; `waiting`: it has not ended but none of its starts runs (requeued, pending)."""
    mine = tuple(s for j, s in starts if j == job_id)
    if running and mine:
        mine = (*mine[:-1], replace(mine[-1], end=None, ended="running"))
    mine = _from_allocations(mine, allocs)
    ends = [a.end for a in allocs if a.end is not None]
    return JobTimes(job_id, gpus, submitted, mine, max(ends) if ends and not running else None, tuple(allocs),
                    running, waiting and not running, marks_recorded)

