"""The hang watchdog: a rank whose step progress stops for longer than its bound dumps every thread's Python stack
into RUN/stacks/restart-N/rank-R.txt, records one failure that begins with `hung:`
(hpcjobs.protocol.faultpolicy.kinds.HUNG) and exits with HANG_EXIT (124); the job's recovery (trainers/recover.py) takes
it from there. Torch-free.

Armed on the ranks that report their steps: the shared trainer (trainers/run.py arms it, trainers/meter.py's `tick`
marks each step) and a user's `transformers.Trainer` or Lightning `Trainer` for the length of `train()`/`fit()`
(trainers/integrations/), and an accelerate `resumable` loop where the user declared its longest unmarked pause
(HPCJOBS_STALL_S; trainers/integrations/account.py). A user's own script that reports no steps is never armed:
nothing could tell its long pause from a hang.

The bound, measured from the last sign of progress (a finished step, an evaluation batch, a save's end), is learned
from the rank's measured step times (trainers/hangbound.py): the start-up bound until three steps are measured, then
max(the floor, 20 × the median recent step time), plus an allowance while a checkpoint save is in flight; the floor
is `recovery.hang_min_s` (10 s by default), or HPCJOBS_STALL_S where the user declared a longer stall. With the old
floor (300 s) a SIGSTOPped rank's job waited for the 120 s collective timeout and resumed 188.6 s after the fault on
the test cluster; with the learned bound its peers' watchdogs end the step in ~11 s (figures: docs/how-to/
self-healing.md).

A rank that was itself stopped (SIGSTOP, a suspended job) or starved (a call that held the GIL) says so: its watchdog
thread polls every POLL_S, so a poll (or a late mark) that comes PAUSED_S or more after the thread's last one means
the whole process did not run, and the failure's text carries DID_NOT_RUN. The peers that waited for it in a
collective ran on (their threads polled): the diagnosis names the rank that did not run, not a peer that noticed.

Two timers watch the same deadline. A Python thread (POLL_S) fires: it dumps the stacks, records the failure and
exits. Behind it, faulthandler's C-level timer (`dump_traceback_later`), re-armed from the step marks at most every
`slack` seconds (so a step pays one comparison), dumps the stacks by itself between one and two `slack`s after the
deadline, without the GIL: a rank whose interpreter is stuck in C code holding the GIL still leaves its stacks
(nothing else, then: the peers' watchdogs or the collective timeout end the job). Both timers count wall time: a
rank that was SIGSTOPped past its bound dumps at once when it runs again (Slurm sends SIGCONT before its SIGTERM and
SIGKILL). So does a job that Slurm suspended (`scontrol suspend`, PreemptMode=SUSPEND) for longer than its bound: it
is taken as hung when resumed.

The stack file is opened when the watchdog is armed (the C timer needs a file it can write without Python) and
removed again, empty, when it is disarmed: a rank killed while armed (SIGKILL) leaves an empty one, which says
nothing. What a firing watchdog leaves (the stacks, the failure, the log line) is trainers/hangreport.py. Cost per
step: bench/watchdog.py (a step mark is well under a microsecond; the figure is in its docstring).
One watchdog per process; a script's own `faulthandler.dump_traceback_later` is replaced while it is armed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Protocol

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.faultpolicy.kinds import DID_NOT_RUN, HANG_EXIT, HUNG
from hpcjobs.protocol.runfolder import RunFolder
from trainers import ranklog
from trainers.distenv import DistEnv, DistEnvError, from_environ
from trainers.hangbound import (
    HANG_MIN,
    STEPS_MEASURED,
    WINDOW,
    Bound,
    floor_of,
    measured_saves,
    save_allowance,
    startup_bound,
    step_bound,
)
from trainers.hangreport import leave_word

POLL_S = 1.0
"""How often the Python thread looks: a hang is found at most this late."""
PAUSED_S = 5.0
"""A gap this long between the watchdog thread's polls (due every POLL_S) means the process did not run."""
LEAVE_WORD_S = 30.0
"""How long a firing watchdog waits for its dump and record (a filesystem may be what hangs) before it exits."""


class Alive(Protocol):
    def is_alive(self) -> bool: ...


@dataclass
class SaveInFlight:
    step: int
    began: float
    until: Alive | None = None
    """A background save's thread: in flight while it lives. None: a foreground save, in flight until `saved()`
    or the next step."""


class Watchdog:
    """One rank's watchdog (module docstring). `start()` opens the stack file and starts both timers; `stop()`
    undoes it. The marks (`progress`, `alive`, `saving`, `saved`) run on the training thread."""

    def __init__(self, run: RunFolder, env: DistEnv, floor: float, startup: Bound,
                 save_costs: list[float] | None = None, floor_how: str = HANG_MIN) -> None:
        self.run, self.env, self.floor, self.startup, self.floor_how = run, env, floor, startup, floor_how
        self.path = run.stack_file(env.restart, env.rank)
        self.step_times: deque[float] = deque(maxlen=WINDOW)
        self.save_costs = list(save_costs or [])
        self.step: int | None = None
        self.last_step_at: float | None = None
        self.base = time.monotonic()
        """The last sign of progress: the bound is measured from here."""
        self.save: SaveInFlight | None = None
        self.rearm_at = 0.0
        self.polled_at = self.base
        """When the watchdog thread last looked (monotonic): a long gap since means the process did not run."""
        self.limit = float("inf")
        self.file: IO[str] | None = None
        self._stop = threading.Event()
        self._firing = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- the marks (the training thread) --------------------------------------------------------------------------

    def progress(self, step: int) -> None:
        """Step `step` is done. The hot path: a few attributes and one comparison, unless the C timer is due."""
        now = time.monotonic()
        if now - self.base > self.limit:
            self.late(now)
        if self.last_step_at is not None:
            self.step_times.append(now - self.last_step_at)
        self.step, self.last_step_at, self.base = step, now, now
        if self.save is not None and self.save.until is None:
            self.saved()  # the loop went on: a foreground save (a library's own) is over
        if now > self.rearm_at or len(self.step_times) == STEPS_MEASURED:  # or the measured bound takes over
            self.rearm(now)

    def alive(self) -> None:
        """Progress that is not a step (an evaluation batch): the bound starts again, no step time is measured."""
        now = time.monotonic()
        if now - self.base > self.limit:
            self.late(now)
        self.base = now
        if now > self.rearm_at:
            self.rearm(now)

    def saving(self, step: int) -> None:
        """A checkpoint save of `step` begins: the bound grows by the save allowance until `saved()`."""
        self.save = SaveInFlight(step, time.monotonic())
        self.rearm(self.save.began)

    def saved(self, until: Alive | None = None) -> None:
        """The save returned to the loop; `until`: the thread that still writes it (a background save)."""
        save = self.save
        if save is None:
            return
        if until is not None and until.is_alive():
            self.save = SaveInFlight(save.step, save.began, until)
            return
        now = time.monotonic()
        self.save_costs.append(now - save.began)
        self.save, self.base = None, now
        self.rearm(now)

    # --- the deadline ---------------------------------------------------------------------------------------------

    def bound(self) -> Bound:
        return step_bound(self.floor, list(self.step_times), self.startup, self.floor_how)

    def overdue(self, now: float) -> str | None:
        """The failure's text if the rank is hung at `now`, else None."""
        save = self.save
        if save is not None and save.until is not None and not save.until.is_alive():
            self.saved()  # a background save that finished
            save = None
        bound = self.bound()
        after = "since the start" if self.step is None else f"after step {self.step}"
        if save is None:
            if now - self.base <= bound.seconds:
                return None
            return f"{HUNG} no step progress for {now - self.base:.0f} s {after} (bound {bound.words()})"
        allowance = save_allowance(self.floor, self.save_costs, self.floor_how)
        if now - save.began > allowance.seconds:
            return (f"{HUNG} the checkpoint save of step {save.step} still in flight after {now - save.began:.0f} s "
                    f"(allowance {allowance.words()}); last step progress {after}")
        if now - self.base <= bound.seconds + allowance.seconds:
            return None
        return (f"{HUNG} no step progress for {now - self.base:.0f} s {after}, the save of step {save.step} in "
                f"flight (bound {bound.words()}, plus the save allowance {allowance.words()})")

    def late(self, now: float) -> None:
        """A mark that comes after the deadline: the rank was hung, but neither timer could act (stopped by SIGSTOP
        and just continued, the Python thread starved): it fires now, before the mark hides the hang."""
        why = self.overdue(now)
        if why is not None:
            self.fire(why + self.paused(now), late=True)

    def paused(self, now: float) -> str:
        """The words a failure gets when this process itself did not run (module docstring), else nothing."""
        gap = now - self.polled_at
        return f" ({DID_NOT_RUN} for {gap:.0f} s: stopped by a signal, suspended, or starved)" \
            if gap >= PAUSED_S and self._thread is not None else ""

    def rearm(self, now: float) -> None:
        """Re-arm the C timer to fire between one and two `slack`s past the Python deadline; `limit` is the
        deadline a mark compares itself with (refreshed here; past it, `late` asks `overdue`, which decides)."""
        if self.file is None:
            return
        bound = self.bound().seconds
        if self.save is not None:
            bound += save_allowance(self.floor, self.save_costs, self.floor_how).seconds
        slack = max(2 * POLL_S, bound / 20)
        faulthandler.dump_traceback_later(bound + 2 * slack, file=self.file)  # joins the timer it replaces
        self.rearm_at, self.limit = now + slack, bound
        if os.fstat(self.file.fileno()).st_size:  # the timer dumped, yet here is progress: a slow step, no hang
            self.file.truncate(0)  # (the bound grew faster than the timer followed it: a step time that jumped)

    # --- arming and firing ----------------------------------------------------------------------------------------

    def start(self) -> Watchdog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")  # open until stop(): the C timer writes into it
        self.base = self.polled_at = time.monotonic()
        self.rearm(self.base)
        self._thread = threading.Thread(target=self._watch, name="hpcjobs-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S)
        self.file.close()
        self.file = None
        with contextlib.suppress(OSError):
            if self.path.stat().st_size == 0:
                self.path.unlink()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            why = self.overdue(now)
            if why is not None and not self._stop.is_set():
                self.fire(why + self.paused(now))
            self.polled_at = now

    def fire(self, why: str, late: bool = False) -> None:
        """Dump, record, exit (once: the thread and a late mark may both find the hang); the dump and the record
        on a thread of their own, so that a filesystem that hangs cannot keep the rank from exiting."""
        if not self._firing.acquire(blocking=False):
            threading.Event().wait()  # the other one ends the process
        faulthandler.cancel_dump_traceback_later()  # waits for the C timer if it is dumping right now
        word = threading.Thread(target=leave_word, name="hpcjobs-watchdog-word", daemon=True,
                                args=(why, late, self.file, self.path, self.env, self.run, self.step,
                                      round(time.monotonic() - self.base, 3)))
        word.start()
        word.join(LEAVE_WORD_S)
        os._exit(HANG_EXIT)


_current: Watchdog | None = None


def _before_fork() -> None:
    """A forked child that exits normally (not by os._exit, as DataLoader's workers do) would hang for ever in
    faulthandler's finalization, joining a C timer thread it does not have (measured: Python 3.11): no C timer
    across a fork, re-armed in the parent once the child exists."""
    if _current is not None and _current.file is not None:
        faulthandler.cancel_dump_traceback_later()


def _after_fork_in_parent() -> None:
    if _current is not None:
        _current.rearm(time.monotonic())


def _after_fork_in_child() -> None:
    global _current
    _current = None  # the child is no rank: its marks do nothing, and it has no watchdog thread


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def progress(step: int) -> None:
    """Step `step` is done on this rank (nothing when no watchdog is armed)."""
    if _current is not None:
        _current.progress(step)


def alive() -> None:
    if _current is not None:
        _current.alive()


def saving(step: int) -> None:
    if _current is not None:
        _current.saving(step)


def saved(until: Alive | None = None) -> None:
    if _current is not None:
        _current.saved(until)


@contextlib.contextmanager
def armed(run: RunFolder | None = None, env: DistEnv | None = None, contract: LaunchContract | None = None,
          environ: Mapping[str, str] | None = None) -> Iterator[Watchdog | None]:
    """A watchdog for the body, on a launched rank (one with a launch contract; `run`, `env` and `contract` default
    to the rank's own); outside one, or when one is already armed, nothing."""
    global _current
    environ = os.environ if environ is None else environ
    contract = contract or LaunchContract.current(environ)
    if _current is not None or contract is None or not contract.run_dir:
        yield None
        return
    try:
        env = env or from_environ(environ)
    except DistEnvError:
        yield None
        return
    run = run or RunFolder(contract.run_dir)
    try:
        floor, how = floor_of(contract.recovery.hang_min_s, environ)
    except DistEnvError as e:
        ranklog.warn(f"hpcjobs: {e}; the hang watchdog keeps recovery.hang_min_s", every_rank=True)
        floor, how = float(contract.recovery.hang_min_s), HANG_MIN
    dog = Watchdog(run, env, floor, startup_bound(floor, environ, how), measured_saves(run), how).start()
    _current = dog
    try:
        yield dog
    finally:
        _current = None
        dog.stop()


def current() -> Watchdog | None:
    return _current

