"""Advice lines of `hpcjobs goodput`, each from the job's own measured records (pure).

- The checkpoint interval: Young/Daly's first-order optimum, sqrt(2 × C × MTBI), with C the measured time a periodic
  save held the training loop and MTBI the job's own allocated time per interruption (a start that ended without
  finishing), compared with the interval the job used.
- Slurm's requeue hold: a requeued job is held (Reason=BeginTime) until its credential expires, cred_expire + 1 s
  (121 s by default; 5 s on the test cluster, docs/design: 6-9 s requeue → running), before it may start again.
- A profile's `seconds_before` shorter than a measured stop (signal → checkpoint committed) or foreground save: the
  time-limit stop would not commit before Slurm kills the job.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from hpcjobs.goodput import Goodput, Start

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
    cost = periodic_save_cost(starts)
    every = save_interval_steps(starts)
    if not g.interruptions or not cost or not step_s or not every:
        return None
    mtbi = g.allocated_s / g.interruptions
    best_s = young_daly_s(cost, mtbi)
    best_steps = max(1, round(best_s / step_s))
    now_s = every * step_s
    if 0.5 <= best_s / now_s <= 2:
        return None
    return (f"checkpoint interval: every {every} steps (~{now_s:.3g} s) now; with a save costing the loop "
            f"{cost:.3g} s and one interruption per {mtbi:.3g} s of allocation ({g.interruptions} seen), "
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


def advice(g: Goodput, starts: Sequence[Start], step_s: float | None, configured_before: int | None) -> list[str]:
    lines = (checkpoint_interval(g, starts, step_s), requeue_hold(g), seconds_before(starts, configured_before))
    return [line for line in lines if line]


def step_time(times: Sequence[tuple[int, int, float]]) -> float | None:
    """The median seconds per step from (restart, step, time) log records, between consecutive records of a start."""
    spans = [(t2 - t1) / (s2 - s1) for (r1, s1, t1), (r2, s2, t2) in zip(times, times[1:], strict=False)
             if r1 == r2 and s2 > s1 and t2 > t1]
    return statistics.median(spans) if spans else None
