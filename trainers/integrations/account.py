"""One account of a user's script's training (HF Trainer, Lightning, the accelerate loop), in the records the shared
trainer writes, so that `status`, `list`, `compare` and `goodput` tell the same truth for it (issue 37).

Before, the integrations wrote only their checkpoints' marks: `status` showed the stop's step (or none) as the last
step of a job that trained on to its end, and `goodput` booked everything after the launch as start-up (no
first-step mark) with 0 s productive. Now, per start:

- startup.jsonl: the `ready` mark when training begins (model built, checkpoint loaded: the library's own train
  start) and `first_step` at the first step end, with the step the start began at (trainers/startup.py);
- heartbeat.json (rank 0): the step and the time, at most once a second and at the end of training;
- metrics.jsonl (rank 0): each loss the library logs (the Trainer's `on_log`, Lightning's logged `loss`), with its
  step: `compare`'s final loss;
- saves.jsonl (rank 0): each checkpoint the integrations mark, from its pending mark to its completion mark: how
  long the training loop waited for it (integrations/marks.py calls `save_began` and `save_done`).

The hang watchdog (trainers/watchdog.py): the HF and Lightning integrations arm it themselves (their evaluation
batches are marked). A script's own loop (the accelerate `resumable` loop) gets it from here only when the user
declared the longest pause its loop makes without a mark (HPCJOBS_STALL_S, hpcjobs.protocol.timeouts): its body is
the script's own code and may hold an evaluation no mark shows, which a bound of seconds (issue 40) would take for a
hang. Then each step end marks progress and each marked save is allowed for.

The `imported` and `joined` marks stay the shared trainer's: a script's imports and rendezvous are its own code; the
time from the launch to `ready` is start-up as a whole. What it costs a step: a time.time() and a comparison (the
heartbeat's file write once a second, on rank 0).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.runfolder import FIRST_STEP, READY, RunFolder, append_jsonl
from hpcjobs.protocol.timeouts import STALL

if TYPE_CHECKING:
    from trainers.distenv import DistEnv

BEAT_S = 1.0
"""The most often rank 0 rewrites heartbeat.json."""


class Account:
    """This process's account of its start: which step it began at, whether its first step is done, its last."""

    def __init__(self) -> None:
        self.run: RunFolder | None = None
        self.env: DistEnv | None = None
        self.start_step: int | None = None
        self.step: int | None = None
        self.first_done = False
        self.beat = 0.0
        self.saves: dict[Path, float] = {}
        self.dog: contextlib.ExitStack | None = None
        """The hang watchdog this account armed (module docstring), until `end`."""

    def begin(self, step: int) -> None:
        """Training begins at `step` (0 fresh, else the step resumed from); outside a launched rank nothing is
        recorded."""
        from trainers import preemption, startup
        from trainers.distenv import DistEnvError, from_environ
        startup.mark(READY)
        self.start_step, self.step, self.first_done = step, step, False
        contract = LaunchContract.current()
        self.run = RunFolder(contract.run_dir) if contract and contract.run_dir else None
        try:
            self.env = from_environ(os.environ, preemption.STATE.job)  # the launcher's job environment, if any
        except DistEnvError:
            self.run = None
        self.arm()

    def arm(self) -> None:
        """The hang watchdog for a script's own loop, where the user declared its longest unmarked pause."""
        from trainers import watchdog
        if self.dog is not None or self.run is None or watchdog.current() is not None or not os.environ.get(STALL[0]):
            return
        stack = contextlib.ExitStack()
        if stack.enter_context(watchdog.armed()) is None:
            stack.close()
            return
        self.dog = stack

    def step_done(self, step: int) -> None:
        """A step ended (every rank)."""
        self.step = step
        if self.dog is not None:
            from trainers import watchdog
            watchdog.progress(step)
        if self.run is None or self.env is None:
            return
        if not self.first_done:
            from trainers import startup

            self.first_done = True
            startup.mark(FIRST_STEP)
            with contextlib.suppress(OSError):
                startup.record(self.run, self.env, self.start_step)
        now = time.time()
        if self.env.rank == 0 and now - self.beat >= BEAT_S:
            self.beat = now
            with contextlib.suppress(OSError):
                self.run.write_heartbeat(step, restart=self.env.restart)

    def logged(self, step: int, loss: float) -> None:
        """The library logged a training loss at `step` (rank 0's is the one recorded)."""
        if self.run is not None and self.env is not None and self.env.rank == 0:
            with contextlib.suppress(OSError):
                append_jsonl(self.run.metrics, {"step": step, "loss": float(loss), "time": time.time(),
                                                "restart": self.env.restart})

    def end(self) -> None:
        """Training ended (its last step, or a stop): the heartbeat says where; a watchdog this account armed ends."""
        if self.dog is not None:
            self.dog.close()
            self.dog = None
        if self.run is not None and self.env is not None and self.env.rank == 0 and self.step is not None:
            with contextlib.suppress(OSError):
                self.run.write_heartbeat(self.step, restart=self.env.restart)

    def save_began(self, folder: Path) -> None:
        self.saves[folder] = time.time()
        if self.dog is not None:
            from trainers import watchdog
            watchdog.saving(self.step or 0)

    def save_done(self, folder: Path, step: int) -> None:
        """Every rank, once the save's completion mark is written: rank 0 writes saves.jsonl's line."""
        if self.dog is not None:
            from trainers import watchdog
            watchdog.saved()
        began = self.saves.pop(folder, None)
        if began is None or self.run is None or self.env is None or self.env.rank != 0:
            return
        with contextlib.suppress(OSError):
            append_jsonl(self.run.saves, {"job_id": self.env.job_id, "restart": self.env.restart, "step": step,
                                          "time": began, "blocking_s": round(time.time() - began, 4),
                                          "background": False})


ACCOUNT = Account()
"""The one account of this process (a rank runs one training at a time)."""
