"""The hang watchdog's bound (trainers/watchdog.py): how long a rank may go without a sign of progress before it is
taken as hung, learned from its own measured step times. Torch-free.

Why learned, and why the floor is seconds (issue 40): with a fixed floor of 300 s (`recovery.hang_min_s`'s old
default) a hung rank was never found by the watchdog: the peers' training collectives timed out first (120 s,
HPCJOBS_COLLECTIVE_TIMEOUT), and on the test cluster the job resumed 188.6 s after a rank was SIGSTOPped. A step of
the example LM there takes well under a second, so 20 × its step time is under 10 s: the floor alone decided. Now:

- Before STEPS_MEASURED step times are known (compilation, warm-up, loading a checkpoint, a cold node's first
  steps): the start-up bound, max(the floor, HPCJOBS_INIT_TIMEOUT): what the process group already allows its
  collectives before the first step (trainers.dist), so a slow but healthy start-up is never called a hang. Each
  start-up stage (trainers.startup's marks: model built and checkpoint loaded, first step) starts it again.
- Then max(the floor, K × the median of the last WINDOW step times). The median, not the mean or the last: slow
  single steps (a log step's all-reduce and host sync, the data loader refilling, a garbage collection, a tracker's
  upload) a few times the median move it little. K = 20 leaves room for a step ten times the median and still ends
  a real hang (which lasts forever) within 20 steps' time.
- The floor: max(recovery.hang_min_s, HPCJOBS_STALL_S). hang_min_s (profile key) is 10 s by default: it keeps fast
  steps (milliseconds) from turning a short stall of the machine (swapping, a busy shared filesystem) into a
  recovery. HPCJOBS_STALL_S (hpcjobs.protocol.timeouts) is the stall a user declares for a job whose loop pauses
  without a mark (a data loader that refills a shuffle buffer for minutes, an own evaluation the integrations do
  not see).
- A checkpoint save in flight adds an allowance, max(the floor, SAVE_K × the longest save measured: the run's
  saves.jsonl `blocking_s` and this start's own saves, whole), or before any was measured the control group's wait
  for a checkpoint barrier (CONTROL_TIMEOUT_MIN_S, 1800 s: rank 0 alone may write for minutes). A save still in
  flight past its allowance counts as a hang too, also while the loop goes on around a background save: a save stuck
  on a filesystem.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from hpcjobs.protocol.runfolder import RunFolder, read_jsonl
from hpcjobs.protocol.timeouts import INIT_TIMEOUT, STALL
from trainers.distenv import CONTROL_TIMEOUT_MIN_S, setting_seconds

K = 20
"""The step-time bound is K × the median recent step time (see the module's docstring for why 20)."""
WINDOW = 32
"""How many recent step times the median is taken over: recent enough to follow a run that slows down."""
STEPS_MEASURED = 3
"""Step times needed before the start-up bound gives way to the measured one (the first step itself is start-up)."""
SAVE_K = 4
"""A save in flight is allowed SAVE_K × the longest save measured: a shared filesystem's writes vary that much."""
HANG_MIN = "recovery.hang_min_s"
"""The floor's name in a bound's text when the profile's key decided it."""


@dataclass(frozen=True)
class Bound:
    seconds: float
    how: str
    """How it was derived, for the failure's text: `20 × 2.0 s step time`."""

    def words(self) -> str:
        return f"{self.seconds:.0f} s = {self.how}" if self.how else f"{self.seconds:.0f} s"


def floor_of(hang_min_s: float, environ: Mapping[str, str]) -> tuple[float, str]:
    """The floor and its name: the profile's hang_min_s, or the user's declared stall (HPCJOBS_STALL_S) if longer.
    A malformed HPCJOBS_STALL_S raises DistEnvError (the rank's start-up says it in one line)."""
    if not environ.get(STALL[0]):
        return float(hang_min_s), HANG_MIN
    stall = setting_seconds(STALL, environ)
    return (stall, STALL[0]) if stall > hang_min_s else (float(hang_min_s), HANG_MIN)


def startup_bound(floor: float, environ: Mapping[str, str], floor_how: str = HANG_MIN) -> Bound:
    init = setting_seconds(INIT_TIMEOUT, environ)
    if init >= floor:
        return Bound(init, f"start-up bound, {INIT_TIMEOUT[0]}")
    return Bound(floor, f"start-up bound, {floor_how}")


def step_bound(floor: float, step_times: list[float], startup: Bound, floor_how: str = HANG_MIN) -> Bound:
    """The bound on the time from one sign of progress to the next (module docstring)."""
    if len(step_times) < STEPS_MEASURED:
        return startup
    median = statistics.median(step_times[-WINDOW:])
    if K * median <= floor:
        return Bound(floor, f"{floor_how}; {K} × {median:.3g} s step time is less")
    return Bound(K * median, f"{K} × {median:.3g} s step time")


def save_allowance(floor: float, save_costs: list[float], floor_how: str = HANG_MIN) -> Bound:
    """What a checkpoint save in flight adds to the bound, and how long the save itself may take."""
    if not save_costs:
        return Bound(max(floor, CONTROL_TIMEOUT_MIN_S), "no save measured yet: the checkpoint barrier's wait")
    longest = max(save_costs)
    if SAVE_K * longest <= floor:
        return Bound(floor, floor_how)
    return Bound(SAVE_K * longest, f"{SAVE_K} × {longest:.3g} s longest save")


def measured_saves(run: RunFolder) -> list[float]:
    """The run's earlier foreground saves' blocking times (rank 0 writes them): the whole save. A background save's
    is its staging only, far less than its writing, which the allowance must cover."""
    return [float(r["blocking_s"]) for r in read_jsonl(run.saves, {"blocking_s": (int, float)})
            if r.get("background") is False]
