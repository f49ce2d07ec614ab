"""Advice lines of `hpcjobs goodput`, each from the job's own measured records (pure).

- The checkpoint interval: Young/Daly's first-order optimum, sqrt(2 × C × MTBI), with C the measured time a periodic
  save held the training loop and MTBI the job's own allocated time per interruption (a start that ended without
  finishing), compared with the interval the job used.
- Slurm's requeue hold: a requeued job is held (Reason=BeginTime) until its credential expires, cred_expire + 1 s
  (121 s by default; 5 s on the test cluster, docs/design: 6-9 s requeue → running), before it may start again.
- A profile's `seconds_before` shorter than a measured stop (signal → checkpoint committed) or foreground save: the
  time-limit stop would not commit before Slurm kills the job.
- A time limit whose warning and measured start-up leave each start little to train (a long run in chunks): the
  --time that would leave most of each start to training.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from hpcjobs.goodput.buckets import Goodput, Start
from hpcjobs.profiles.slurmtime import format_time
from hpcjobs.protocol.contract import EARLY_SIGNAL_S
from hpcjobs.protocol.runfolder import FIRST_STEP
from hpcjobs.request.chunks import CHUNK_SHARE, GOOD_SHARE

MIN_SAVES_APART = 4
"""No checkpoint interval is advised shorter than this many times what a save costs the loop."""
LOST_WORK = frozenset({"failed", "lost"})
"""How a start ended when it lost the steps since its newest checkpoint (Start.ended)."""
HOLD_ADVICE_S = 10.0
"""Above this mean requeue hold a line says where it comes from."""
SLURM_DEFAULT_HOLD_S = 121


def periodic_save_cost(starts: Sequence[Start]) -> float | None:
    """The median time a periodic save held the loop (a start's last save, its stop or end, left out)."""
    costs = [s.blocking_s for st in starts for s in st.saves[:-1]]
    return statistics.median(costs) if costs else None


def save_interval_steps(starts: Sequence[Start]) -> int | None:
    gaps = [b.step - a.step for st in starts for a, b in zip(st.saves, st.saves[1:], strict=False) if b.step > a.step]
    return int(statistics.median(gaps)) if gaps else None


def young_daly_s(save_cost_s: float, mtbi_s: float) -> float:
    return math.sqrt(2 * save_cost_s * mtbi_s)


def checkpoint_interval(g: Goodput, starts: Sequence[Start], step_s: float | None) -> str | None:
    """Only starts that lost work count as interruptions: one stopped when asked (the time limit, a preemption)
    committed a checkpoint of its last step, and a job in time-limit chunks was advised --ckpt-every 5 for them."""
    cost = periodic_save_cost(starts)
    every = save_interval_steps(starts)
    faults = sum(st.ended in LOST_WORK for st in starts)
    if not faults or not cost or not step_s or not every:
        return None
    mtbi = g.allocated_s / faults
    best_s = young_daly_s(cost, mtbi)
    best_steps = max(1, round(best_s / step_s))
    now_s = every * step_s
    if 0.5 <= best_s / now_s <= 2 or best_s < MIN_SAVES_APART * cost:
        # Below a few save costs apart the loop would spend most of its time saving: interruptions that frequent
        # are the problem to fix, not the interval (issue 38: --ckpt-every 17, 0.85 s, was advised).
        return None
    return (f"checkpoint interval: every {every} steps (~{now_s:.3g} s) now; with a save costing the loop "
            f"{cost:.3g} s and one interruption per {mtbi:.3g} s of allocation ({faults} seen), "
            f"Young/Daly's sqrt(2 × {cost:.3g} × {mtbi:.3g}) = {best_s:.3g} s, i.e. --ckpt-every {best_steps}")


def requeue_hold(g: Goodput) -> str | None:
    if not g.holds:
        return None
    mean = g.buckets["requeue_hold"] / g.holds
    if mean <= HOLD_ADVICE_S:
        return None
    return (f"requeue hold: Slurm held the job {mean:.0f} s on average after each of its {g.holds} requeue(s) before "
            f"it could start again (cred_expire + 1 s; Slurm's default {SLURM_DEFAULT_HOLD_S} s). HINT: the cluster's "
            "admins can lower it (slurm.conf AuthInfo=cred_expire=N); it is paid on every preemption and node failure")


def seconds_before(starts: Sequence[Start], configured: int | None) -> str | None:
    measured = [st.stop_to_commit_s for st in starts if st.stop_to_commit_s is not None]
    measured += [s.blocking_s for st in starts for s in st.saves if not s.background]
    if configured is None or not measured or max(measured) < configured:
        return None
    worst = max(measured)
    return (f"seconds_before: the profile warns {configured} s before the time limit, but a stop or save here took "
            f"{worst:.3g} s: a time-limit stop would be killed before its checkpoint commits. HINT: preemption: "
            f"seconds_before: {math.ceil(2 * worst)} in the profile")


def short_chunks(starts: Sequence[Start], time_limit_s: int | None, warn_s: int | None) -> str | None:
    """A time limit of which the profile's warning and the start-up leave each start less than half to train: the
    --time that leaves about 80% (and the warning a stop here needs, when it is much shorter)."""
    if not time_limit_s or warn_s is None:
        return None
    chunks = [(st.end - st.marks[FIRST_STEP], st.marks[FIRST_STEP] - st.begin) for st in starts
              if st.ended == "stopped" and st.end is not None and FIRST_STEP in st.marks
              and st.end - st.begin >= time_limit_s - warn_s - EARLY_SIGNAL_S]  # stopped near the limit
    if not chunks:
        return None
    trained, startup = statistics.median(t for t, _ in chunks), statistics.median(u for _, u in chunks)
    if trained >= CHUNK_SHARE * time_limit_s:
        return None
    better = max(time_limit_s + 60, math.ceil((warn_s + startup) / (1 - GOOD_SHARE) / 60) * 60)
    stops = [st.stop_to_commit_s for st in starts if st.stop_to_commit_s is not None]
    shorter = max(30, math.ceil(3 * max(stops))) if stops else warn_s
    also = (f", or preemption: seconds_before: {shorter} in the profile (a stop here committed within "
            f"{max(stops):.3g} s)" if stops and shorter < warn_s / 2 else "")
    return (f"time limit: each start stopped at its {format_time(time_limit_s)} limit trained ~{trained:.0f} s "
            f"(median of {len(chunks)}): start-up took ~{startup:.0f} s and the profile's warning {warn_s} s before "
            f"the end. HINT: --time {format_time(better)} leaves ~{GOOD_SHARE:.0%} of each start to training{also}")


def advice(g: Goodput, starts: Sequence[Start], step_s: float | None, configured_before: int | None,
           time_limit_s: int | None = None) -> list[str]:
    lines = (checkpoint_interval(g, starts, step_s), requeue_hold(g), seconds_before(starts, configured_before),
             short_chunks(starts, time_limit_s, configured_before))
    return [line for line in lines if line]


def step_time(times: Sequence[tuple[int, int, float]]) -> float | None:
    """The median seconds per step from (restart, step, time) log records, between consecutive records of a start."""
    spans = [(t2 - t1) / (s2 - s1) for (r1, s1, t1), (r2, s2, t2) in zip(times, times[1:], strict=False)
             if r1 == r2 and s2 > s1 and t2 > t1]
    return statistics.median(spans) if spans else None
