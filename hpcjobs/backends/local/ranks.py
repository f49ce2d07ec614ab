"""A local job's ranks as processes on this machine: started together, ended together when one fails (as srun's
--kill-on-bad-exit), started again when the failure was nobody's bug (hpcjobs.protocol.faultpolicy.recoverable), and
stopped at a checkpoint on Ctrl-C (`Stopper`). hpcjobs/backends/local/local.py runs the jobs with them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from hpcjobs.backends import Submitted
from hpcjobs.protocol import userstop
from hpcjobs.protocol.faultpolicy.diagnosis import Failure
from hpcjobs.protocol.faultpolicy.recoverable import judge, record
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import FinalState, StopReason
from hpcjobs.request.spec import JobSpec


def group_code(procs: list[subprocess.Popen[bytes]]) -> int | None:
    """One job's ranks: None while they run; their exit code once all ended, or once one failed, after stopping
    the rest (like srun --kill-on-bad-exit)."""
    codes = [p.poll() for p in procs]
    failed = [c for c in codes if c not in (None, 0)]
    if failed:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # as Slurm: a stopped rank runs again to end (its watchdog dumps)
                p.terminate()
        deadline = time.time() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
        return failed[0]
    return 0 if all(c == 0 for c in codes) else None


def wait_all(procs: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every rank of one job (see group_code)."""
    while (code := group_code(procs)) is None:
        time.sleep(0.2)
    return code


def device_slice(slot: int, ranks: int, environ: dict[str, str]) -> dict[str, str]:
    """Sweep tasks running side by side each see their own GPUs (rank r uses the r-th visible one); nothing to
    split for one task at a time."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range((slot + 1) * ranks)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[slot * ranks:(slot + 1) * ranks])}


Job = tuple[RunFolder, str, int]
"""A running job of the launcher: its run folder, its id, the number of its running start."""


class Stopper:
    """Ctrl-C (or SIGTERM, `hpcjobs cancel`) is passed on to every rank (see the module's docstring): a task (or a
    script in the protocol) stops at the next step boundary after a checkpoint, any other script at once; the first
    line says which case applies (hpcjobs.protocol.userstop), and the ranks are told what the user did. A second one
    says a stop is under way; a third kills the ranks at once (the last checkpoint stays) and the job counts as
    stopped by the user, not failed."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], stop_signal: int, kind: str = "task",
                 jobs: Callable[[], list[Job]] = list) -> None:
        self.procs, self.stop_signal, self.kind, self.count, self.jobs = procs, stop_signal, kind, 0, jobs
        self.signum: int | None = None
        """The signal that asked to stop first."""
        self.by = ""
        """What the user did, in their words (Ctrl-C, SIGTERM, hpcjobs cancel)."""

    def exit_code(self, code: int) -> int:
        """A job's code once its ranks ended: a stop asked for by a signal is not a success, even when every rank
        exited 0 at its checkpoint (`hpcjobs submit ... && next` must not go on): 128 + the user's signal, as a
        shell reports a command it interrupted (130 for Ctrl-C, 143 for SIGTERM and cancel), also where the ranks
        ended by the signal they were passed or were killed at the third Ctrl-C. A rank that failed otherwise keeps
        its code."""
        if self.signum is None:
            return code
        return 128 + self.signum if code == 0 or code in ASKED_TO_STOP or self.count >= 3 else code

    def on_signal(self, signum: int, frame: Any) -> None:
        self.count += 1
        jobs = self.jobs()
        if self.count == 1:
            self.signum = signum
            self.by = userstop.words(signum, signum == signal.SIGTERM and any(userstop.cancelled(r, j)
                                                                              for r, j, _ in jobs))
            for run, job_id, _ in jobs:
                userstop.ask(run, job_id, self.by)
            self._send(signum if self.kind == "task" else self.stop_signal)
            joined = self.kind == "task" or any(userstop.joined(r, j) for r, j, _ in jobs)
            note = f"stopping ({self.by}): {userstop.case(self.kind, joined)}"
        elif self.count == 2:
            note = "still stopping; press Ctrl-C once more to kill the ranks now"
        else:
            self._send(signal.SIGKILL)
            for run, _, restart in jobs:
                run.record_stop(StopReason.INTERRUPT, -1, restart, signal=self.by, killed_by_user=True)
            note = f"stopped by you ({self.by}, then Ctrl-C twice): the ranks were killed; the newest finished " \
                   "checkpoint is kept"
        os.write(2, f"\nhpcjobs: {note}\n".encode())  # os.write: no buffered I/O inside a signal handler

    def _send(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)


def rank_preexec() -> None:
    """In each rank, before exec: a session of its own, and if the launching process dies (SIGKILL, or a `| tee`
    that took it down at Ctrl-C), SIGTERM, so the rank stops instead of training on as an orphan: at a checkpoint
    for a task, at once for a script that does not take part in the stop protocol.

    A session, not only a process group (either keeps the terminal's Ctrl-C to the launching process, see
    LocalBackend._start): where the kernel groups CPU time by session (sched_autogroup, on by default in most
    distributions' kernels and on this machine), ranks left in the shell's session share one group's CPU time
    with each other and with the shell's other work, while torchrun gives each rank a session of its own. Measured
    with bench/hf_trainer.py (an HF Trainer script, 2 ranks on 2 cores): a process group each, 1.134 × torchrun's
    step time; a session each, 1.052 × in the same 12 rounds, and 1.016 over 20 rounds against torchrun's 1.018
    against itself."""
    import ctypes

    os.setsid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


ASKED_TO_STOP = frozenset({-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP, 128 + signal.SIGTERM,
                           128 + signal.SIGINT})
"""Exit codes of a rank that someone asked to stop (it ended by the signal, or as a shell does for it)."""


def killed(procs: list[subprocess.Popen[bytes]]) -> list[Failure]:
    """The ranks a signal ended (not the SIGTERM this backend sent the rest), as srun would name them: a rank
    killed writes nothing itself, and its peers' "Connection closed" must not be taken for the cause."""
    return [Failure(rank, socket.gethostname(), f"killed by {signal.Signals(-p.returncode).name}", "the launcher")
            for rank, p in enumerate(procs) if p.returncode is not None and p.returncode < 0
            and -p.returncode != signal.SIGTERM]


def recovered(spec: JobSpec, sub: Submitted, restart: int, code: int, procs: list[subprocess.Popen[bytes]]) -> bool:
    """Whether the job's ranks, which ended with `code`, start again (hpcjobs.protocol.faultpolicy.recoverable: nobody's
    bug, and not too often without a new checkpoint); the recovery's line written when they do, the job's end when it
    gives up."""
    if code in ASKED_TO_STOP:  # `kill` of a rank, a Ctrl-C on it: a signal's usual meaning, not a fault
        return False
    run = RunFolder(sub.run_dir)
    d = judge(run, spec.recovery, sub.job_id, restart, code, killed(procs))
    if d.action == "fail":
        print(f"hpcjobs: job {sub.job_id} ends failed: {d.why}", file=sys.stderr, flush=True)
        run.write_final(FinalState.FAILED, d.why, job_id=sub.job_id)
    if d.action != "relaunch":
        return False
    record(run, sub.job_id, restart, d, how="local")
    return True
