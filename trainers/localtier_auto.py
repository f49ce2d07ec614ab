"""`--local-ckpt-every auto` (the default): the node-local tier's interval chosen by measurement, the most frequent
one whose cost stays within TARGET (2%) of the step time (issue 40).

Each rank times its loop between the tier's per-step calls (LocalTier.due, once after every step). A step interval
that a save or its writer thread overlapped is a dirty one; the others give the clean step time (their median). What
a save cost the loop is the sum over its dirty intervals of their excess over the clean step time: the copies the
loop waited for, the pre-hook's wait, and the CPU the writer took from training (on the 2 shared cores of the test
host, most of it). The interval a rank proposes after save k+1 is the smallest N with cost / (N × step) ≤ TARGET for
the median of its last saves' costs; the writer thread of that save takes the MAX over the ranks in the all-reduce
it already makes, and every rank applies the agreed interval at the next save, after joining that thread: every rank
is then at the same step in the same state, so all keep saving at the same steps (the save's collectives need it).
The first save is at FIRST steps into a start, the second FIRST steps later, then the agreed intervals.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from pathlib import Path

from hpcjobs.protocol.planning.host_plan import COPIES, gib
from trainers.localtier_state import free_room

TARGET = 0.02
"""The tier's cost the interval is chosen for: at most 2% of the step time."""
FIRST = 10
"""Steps into a start to the first save, and between the first two (before any cost was measured)."""
MOST = 100_000
"""The longest interval chosen (a save far slower than a step)."""


class AutoInterval:
    """One rank's measurements: `tick` at each step's end, `saved` at each save, `propose` at the next one."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.clean: deque[float] = deque(maxlen=200)
        self.busy = False
        self.extra = 0.0
        """The excess of the dirty intervals since the last save, seconds."""
        self.costs: deque[float] = deque(maxlen=5)
        self.saves = 0

    def tick(self, writing: bool) -> None:
        """The end of a step: its interval booked as clean or dirty; the next one is dirty while the writer runs."""
        now = time.monotonic()
        if self.last is not None:
            dt = now - self.last
            if self.busy:
                self.extra += dt - self.step_s() if self.clean else 0.0
            else:
                self.clean.append(dt)
        self.last, self.busy = now, writing

    def saved(self) -> None:
        """A save in this step's interval (called after `propose`): the interval to the next tick is dirty."""
        self.busy, self.extra = True, 0.0
        self.saves += 1

    def step_s(self) -> float:
        return statistics.median(self.clean) if self.clean else 0.0

    def propose(self) -> tuple[int, float, float]:
        """At a save: (the interval this rank proposes, 0 for none yet; the cost of a save, s; the step, s)."""
        if self.saves:
            self.costs.append(max(0.0, self.extra))
        step = self.step_s()
        if not self.costs or step <= 0:
            return 0, 0.0, step
        cost = statistics.median(self.costs)
        return every_for(cost, step), cost, step


def every_for(cost_s: float, step_s: float) -> int:
    """The smallest N with cost / (N × step) ≤ TARGET."""
    return max(1, min(MOST, math.ceil(cost_s / (TARGET * step_s) - 1e-9)))


def room_for(state: int, per_node: int, root: Path) -> tuple[bool, str]:
    """Whether the tier's copies (host_plan.COPIES of a rank's `state` bytes, for each rank of the node) fit the
    free space of its folder's file system; the line saying why not (the tier is then off)."""
    need, (room, where) = COPIES * state * per_node, free_room(root)
    if need <= room:
        return True, ""
    return False, (f"--local-ckpt-every auto: the tier needs {gib(need)} a node ({per_node} rank(s) x {COPIES} copies "
                   f"x {gib(state)}), {gib(room)} free in {where}: the tier is off. HINT: HPCJOBS_LOCAL_CKPT_DIR=a "
                   "larger node-local folder, or --strategy fsdp")
