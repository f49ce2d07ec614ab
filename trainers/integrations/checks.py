"""The integrations' stop checks at a cadence, as the shared trainer's: shared by hf_trainer, lightning and
accelerate_loop, whose step ends all call `StepEndGuard.step_ended()`.

Checking at every step end cost a pipelined all-reduce a step (0.4-0.8 ms at 2 CPU ranks: bench/stop_agreement.py);
the shared trainer checks about once a second. With these checks, an unchanged Hugging Face Trainer script's ~13 ms
steps under `hpcjobs submit` take 1.016x torchrun's, torchrun against itself 1.018x (bench/README.md).
Every rank calls `step_ended()` at every step end; the ranks agree only at the steps trainers.agreement.Cadence
names, the same on every rank: every step end over this start's first 12 (while the slowest rank's step time is
measured), then about once a second of training (or every HPCJOBS_STOP_CHECK_EVERY step ends). A check's reduce
runs in the background during the next step and its answer is read at that step's end (the trainer's instead reads
it at the next check: a second later), so a stop waits at most one interval and one step, about a second of training,
at no more cost than the pipelined reduce (a blocking one: 1.5 ms at 2 ranks, 20 ms at 64, bench/stop_agreement.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainers.agreement import Cadence
from trainers.preemption import StopGuard


@dataclass
class StepEndGuard(StopGuard):
    """A StopGuard whose ranks agree at the cadence's step ends only. `every`: the checks' spacing in step ends (0:
    about once a second, from the measured step time)."""

    every: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ends = 0
        """Step ends of this start so far: what the cadence counts (Lightning's are batches, not optimizer steps)."""
        self.cadence = Cadence(self.every, 0)

    def step_ended(self) -> bool:
        """Whether the ranks agreed to stop here. Call it at every step end, on every rank (a collective at the
        cadence's step ends)."""
        self.ends += 1
        # The answer of the check made at the previous step end, whose reduce ran during this step (False if none).
        stop = self._agreement.close() if self._agreement is not None else False
        if self.cadence.due(self.ends) and not stop:
            stop = self.should_stop(pipelined=True)  # starts this check's reduce; answers now only on a single rank
            # The cadence's one all-reduce of the step time (at the 12th step end, after 11 checks, none in flight)
            # goes over the group the stop flag's does: a CPU one, which the guard makes at its first check.
            self.cadence.group = self._agreement.group if self._agreement is not None else None
        return stop
