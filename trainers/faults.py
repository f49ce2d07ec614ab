"""Fault injection for tests: HPCJOBS_FAULT_INJECT=POINT@STEP[:RANK] SIGKILLs this process there, or with
HPCJOBS_FAULT_ACTION=raise raises RuntimeError (a crashing task), =stop sends it SIGSTOP (a hung rank), =comm raises
the error a collective raises when its peer's connection broke (an infrastructure fault, which the job recovers from).
HPCJOBS_FAULT_RESTART=N fires it only in start N (a fault that does not come back after a recovery).
HPCJOBS_FAULT_SLOW_STEP=SECONDS makes every step that much longer (a bigger model, a slower machine): a test that
needs a signal to land mid-run then holds however fast the machine running it is.

Points: `step` (after an optimizer step), `save-shards` (a checkpoint's small files written, its sharded tensors not
yet), `save-written` (checkpoint files written, not committed), `save-marked` (FINISHED written, folder not yet
renamed), `save-renamed` (committed, older ones not yet pruned); an asynchronous save passes the save points in its
background thread. Read once at import, so the training step pays one falsy check when unset.
"""

from __future__ import annotations

import os
import signal
import time

from trainers import ranklog

_SPEC = os.environ.get("HPCJOBS_FAULT_INJECT", "")
_ACTION = os.environ.get("HPCJOBS_FAULT_ACTION", "kill")
_ONLY_IN = os.environ.get("HPCJOBS_FAULT_RESTART", "")


def _seconds(name: str) -> float:
    text = os.environ.get(name) or "0"
    try:
        return float(text)
    except ValueError:
        ranklog.warn(f"hpcjobs: {name}={text!r} is not a number of seconds. HINT: e.g. {name}=0.2, or unset it",
                     every_rank=True)
        raise SystemExit(2) from None


_SLOW_STEP_S = _seconds("HPCJOBS_FAULT_SLOW_STEP")


class InjectedFault(RuntimeError):
    pass


class InjectedCommError(RuntimeError):
    """Stands for torch's DistBackendError (its words, so the diagnosis and the recovery read it as they would)."""


def armed() -> bool:
    return bool(_SPEC) or _SLOW_STEP_S > 0


def maybe_die(point: str, step: int) -> None:
    if point == "step" and _SLOW_STEP_S > 0:
        time.sleep(_SLOW_STEP_S)
    if not _SPEC:
        return
    where, _, rank = _SPEC.partition(":")
    if where != f"{point}@{step}" or (rank and rank != os.environ.get("RANK", "0")):
        return
    if _ONLY_IN and _ONLY_IN != os.environ.get("HPCJOBS_RESTART", "0"):
        return
    # when it struck, in the rank's log: a benchmark's "fault to first resumed step" counts from here
    ranklog.warn(f"hpcjobs: fault injected ({_ACTION}) at {point}@{step}, at {time.time():.3f}", every_rank=True)
    if _ACTION == "raise":
        raise InjectedFault(f"injected at {point}@{step}")
    if _ACTION == "comm":
        raise InjectedCommError(f"DistBackendError: [Gloo] injected at {point}@{step}: Connection reset by "
                                "peer")
    time.sleep(0.2)  # the log's tee is a thread of this process: give it the line before the signal ends it
    os.kill(os.getpid(), signal.SIGSTOP if _ACTION == "stop" else signal.SIGKILL)
