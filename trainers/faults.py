"""Crash injection for tests: HPCJOBS_FAULT_INJECT=POINT@STEP[:RANK] SIGKILLs this process there.

Points: `step` (after an optimizer step), `save-written` (checkpoint files written, not committed), `save-marked`
(FINISHED written, folder not yet renamed), `save-renamed` (committed, older ones not yet pruned). Read once at
import, so the training step pays one falsy check when unset.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("HPCJOBS_FAULT_INJECT", "")


def armed() -> bool:
    return bool(_SPEC)


def maybe_die(point: str, step: int) -> None:
    if not _SPEC:
        return
    where, _, rank = _SPEC.partition(":")
    if where == f"{point}@{step}" and (not rank or rank == os.environ.get("RANK", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
