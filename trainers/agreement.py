"""How the ranks agree on a stop: at which steps they ask (Cadence) and one tiny all-reduce that gives every rank the
same answer (Agreement). The stop protocol (trainers.preemption) asks through these; the shared trainer and the
integrations' step-end checks (trainers.integrations.checks) pace their asking with Cadence."""

from __future__ import annotations

import math
import time
from typing import Any


class Agreement:
    """Every rank gets the same answer to "has any rank been asked to stop?" from a tiny all-reduce (MAX) on the CPU.

    `any_rank` answers now and waits for the slowest rank. `any_rank_pipelined` answers with the reduce it started
    on the previous call and starts the next one, so the collective runs in the background during a training step
    instead of stalling every step (measured on 2 CPU ranks: a blocking check cost ~10% of a 15 ms step); the stop
    comes one check later, the same check on every rank. Call `close()` before the group goes away."""

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self._dist: Any = dist if dist.is_available() and dist.is_initialized() else None
        self.group = group
        self._flag = torch.zeros(1, dtype=torch.int32)  # lives on the CPU: no device sync
        self._pending: Any = None

    def _single(self) -> bool:
        return self._dist is None or self._dist.get_world_size(self.group) == 1

    def any_rank(self, local: bool) -> bool:
        if self._single():
            return local
        self.close()
        self._flag.fill_(1 if local else 0)
        self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag.item())

    def any_rank_pipelined(self, local: bool) -> bool:
        if self._single():
            return local
        answer = self.close()
        self._flag.fill_(1 if local else 0)
        self._pending = self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, group=self.group,
                                              async_op=True)
        return answer

    def close(self) -> bool:
        """Wait for a reduce in flight; returns its answer (False if none)."""
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        return bool(self._flag.item())


class Cadence:
    """At which steps the ranks agree on a stop: every `every` steps, or (every=0) about once per TARGET_S of
    training. The agreement costs a step a fixed time in any case (bench/stop_agreement.py: ~0.2-2 ms at 2-64 ranks
    on one host), which only matters for short steps; checking once a second keeps it negligible and delays a stop
    by a second or two, against a warning of 10 s or more. The step time is measured over this start's steps
    MEASURE[0]..MEASURE[1] (after the first, which compiles and warms up; checking every step meanwhile), and every
    rank takes the slowest rank's, agreed by one all-reduce: the ranks must check at the same steps."""

    TARGET_S = 1.0
    MEASURE = (2, 12)

    def __init__(self, every: int, first_step: int, group: Any = None) -> None:
        self.every, self.first_step, self.group = every, first_step, group
        self._t0 = 0.0
        self.chosen: tuple[int, float] | None = None
        """(every, the slowest rank's step time in s) once measured: the trainer logs it."""

    def due(self, step: int) -> bool:
        """Whether `step` (just finished) is a check. Call it after every step, on every rank."""
        if self.every:
            return step % self.every == 0
        k = step - self.first_step
        if k == self.MEASURE[0]:
            self._t0 = self._now()
        if k == self.MEASURE[1]:
            self.every, step_s = self.decide((self._now() - self._t0) / (self.MEASURE[1] - self.MEASURE[0]))
            self.chosen = (self.every, step_s)
        return True

    @staticmethod
    def _now() -> float:
        """After the GPU caught up: a step queues its kernels and returns long before they ran (twice a start)."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def decide(self, step_s: float) -> tuple[int, float]:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            slowest = torch.tensor([step_s], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
            step_s = float(slowest.item())
        return max(1, math.ceil(self.TARGET_S / max(step_s, 1e-6))), step_s
